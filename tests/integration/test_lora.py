"""LoRA (peft) on the policy: adapters train and reach the rollout engine, the reference is the
base with adapters off, the traps are refused before any step, checkpoints resume exactly and export
round-trips through peft and transformers (resume: test_train_cli.py's resume test, lora
variant)."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from keel.api import train
from keel.errors import ENGINE_OUT_OF_SYNC, LORA_TARGETS, KeelError

LORA = {"lora_rank": 8, "lora_alpha": 16, "target_modules": "all-linear"}


def lora_config(tiny_config, **model):
    tiny_config["actor_rollout_ref"]["model"].update({**LORA, **model})
    tiny_config["actor_rollout_ref"]["actor"]["optim"]["lr"] = 2e-2
    tiny_config["trainer"].update({"test_freq": -1, "val_before_train": False})
    return tiny_config


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_adapters_train_reach_the_engine_and_leave_the_base_alone(tiny_config, tiny_assets):
    cfg = lora_config(tiny_config)
    # the reference: the base, adapters off
    cfg["actor_rollout_ref"]["actor"]["use_kl_loss"] = True
    cfg["trainer"]["total_training_steps"] = 3
    result = train(cfg)
    steps = metrics(result.run_dir)
    assert result.last_step == 3 and all(math.isfinite(m["actor/pg_loss"]) for m in steps)
    # the engine generated with the trained adapters
    assert steps[-1]["rollout/log_prob_gap"] < 1e-4
    # the policy moved away from its base
    assert steps[-1]["actor/ref_kl"] != 0.0
    actor = result.run_dir / "global_step_3" / "actor"
    adapter = load_file(actor / "adapter_model.safetensors")
    # the checkpoint holds adapters only
    assert adapter and all("lora_" in name for name in adapter)
    # B starts at 0, and trained
    assert any(t.abs().sum() > 0 for name, t in adapter.items() if "lora_B" in name)


def test_a_sync_that_never_reaches_the_engine_is_caught(tiny_config, monkeypatch):
    """The failure peers' users find weeks later (verl #7495): rollouts from the base model."""
    from keel.distributed.roles import EngineSync

    monkeypatch.setattr(EngineSync, "push", lambda self, actor_model: None)
    cfg = lora_config(tiny_config)
    cfg["actor_rollout_ref"]["actor"]["optim"]["lr"] = 0.2
    cfg["trainer"]["guards"] = {"max_log_prob_gap": 0.01}
    with pytest.raises(KeelError) as error:
        train(cfg)
    assert error.value.code == ENGINE_OUT_OF_SYNC and "after step 1's update" in error.value.message


@pytest.mark.parametrize(
    "model, needle",
    [
        # half a layer
        ({"target_modules": ["q_proj", "v_proj"]}, "would train nothing"),
        # another architecture's name
        ({"target_modules": ["query_key_value"]}, "do not have"),
        # would untie them
        ({"target_modules": ["lm_head"]}, "tied embeddings"),
        ({"exclude_modules": ["*"]}, "matches none"),
    ],
)
def test_lora_traps_are_refused_before_any_step(tiny_config, model, needle):
    with pytest.raises(KeelError) as error:
        train(lora_config(tiny_config, **model))
    assert error.value.code == LORA_TARGETS and needle in error.value.message
    assert not Path(tiny_config["trainer"]["default_local_dir"], "metrics.jsonl").exists()


def test_a_parameter_training_outside_the_adapters_is_refused(tiny_assets):
    from keel.models.load import load_causal_lm
    from keel.models.lora import apply_lora, plan_lora, require_only_adapters_train

    model = load_causal_lm(tiny_assets["model"], torch.device("cpu"))
    peft_model = apply_lora(
        model, plan_lora(model, 4, ["all-linear"], [], [], "model"), 4, 8, [], torch.float32
    )
    # an embedding left trainable by mistake
    peft_model.get_input_embeddings().weight.requires_grad_(True)
    with pytest.raises(KeelError) as error:
        require_only_adapters_train(peft_model, [])
    assert error.value.code == LORA_TARGETS and "embed_tokens" in error.value.message


def test_keel_check_prints_what_lora_trains(tiny_config):
    from keel.check.preflight import run_checks
    from keel.config.load import load_run

    report = run_checks(*load_run(lora_config(tiny_config)))
    [lora] = [f.message for f in report.findings if f.check == "lora"]
    assert "q_proj" in lora and "down_proj" in lora and "lm_head and embeddings frozen" in lora
    assert "trainable parameters" in lora and "%" in lora


def test_gradient_checkpointing_gives_lora_the_same_gradients(tiny_assets):
    """Trap 8: with frozen embeddings the reentrant checkpoint drops every adapter gradient; keel's
    checkpointing (non-reentrant) gives the gradients of a run without it."""
    from keel.models.load import load_causal_lm
    from keel.models.lora import apply_lora, plan_lora

    def adapter_grads(checkpointing: bool) -> dict:
        torch.manual_seed(0)
        model = load_causal_lm(
            tiny_assets["model"], torch.device("cpu"), gradient_checkpointing=checkpointing
        )
        peft_model = apply_lora(
            model, plan_lora(model, 4, ["all-linear"], [], [], "m"), 4, 8, [], torch.float32
        )
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                # B starts at 0: give A a gradient too
                torch.nn.init.normal_(param, std=0.1)
        peft_model.train()
        ids = torch.randint(0, 200, (2, 12))
        peft_model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}

    plain, checkpointed = adapter_grads(False), adapter_grads(True)
    assert plain and set(plain) == set(checkpointed)
    for name, grad in plain.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(checkpointed[name], grad, msg=name)


def test_export_round_trips_through_peft_and_transformers(tiny_config, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from keel.cli import main

    cfg = lora_config(tiny_config)
    cfg["trainer"]["total_training_steps"] = 2
    result = train(cfg)
    checkpoint = result.run_dir / "global_step_2"
    assert main(["export", str(checkpoint), str(tmp_path / "adapter")]) == 0
    assert main(["export", str(checkpoint), str(tmp_path / "merged"), "--merged"]) == 0
    base = cfg["actor_rollout_ref"]["model"]["path"]
    with_adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter"
    )
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.tensor([[5, 17, 42, 9]])
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(
        with_adapter.generate(input_ids=ids, **kwargs), merged.generate(input_ids=ids, **kwargs)
    )
    plain = AutoModelForCausalLM.from_pretrained(base)
    # adapters are in
    assert not all(torch.equal(p, q) for p, q in zip(plain.parameters(), merged.parameters()))


def test_the_memory_estimate_knows_lora(tiny_config):
    from keel.check.preflight import run_checks
    from keel.config.load import load_run

    ppo = {"actor_rollout_ref.actor.use_kl_loss": True, "algorithm.adv_estimator": "gae"}
    full = run_checks(*load_run(tiny_config, ppo)).memory_gb
    lora = run_checks(
        *load_run(lora_config(tiny_config), {**ppo, "critic.model.lora_rank": 8})
    ).memory_gb
    # the base with adapters off: no second model
    assert "reference" in full and "reference" not in lora
    # The frozen base has no gradients or AdamW moments, and on one worker it is the engine's
    # weights.
    assert (
        lora["rollout_weights"] == full["rollout_weights"]
        and lora["actor_states"] < 0.6 * full["actor_states"]
    )
    assert lora["critic_states"] < 0.6 * full["critic_states"]


def test_a_lora_critic_trains_its_adapters_and_value_head_only(tiny_config, tiny_assets):
    """critic.model.lora_rank: adapters on the critic's backbone, its value head trained in full,
    the backbone's base untouched; keel check plans it like the policy's."""
    from safetensors.torch import load_file as load_weights

    from keel.check.preflight import run_checks
    from keel.config.load import load_config
    from keel.distributed.group import LocalGroup
    from keel.distributed.worker import RoleWorker, WorkerSpec

    overrides = {
        "algorithm.adv_estimator": "gae",
        "critic.model.lora_rank": 4,
        "critic.model.lora_alpha": 8,
        "critic.optim.lr": 1e-2,
        "trainer.device": "cpu",
    }
    cfg = load_config(tiny_config, overrides)
    assert any(
        f.check == "lora" and f.message.startswith("critic: LoRA on")
        for f in run_checks(cfg).findings
    )
    worker = LocalGroup(RoleWorker(WorkerSpec.of(cfg, total_steps=2))).worker
    critic = worker.critic.model
    trained = {name for name, p in critic.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name or name.startswith("value_head.") for name in trained)
    assert {id(p) for group in worker.critic.optimizer.param_groups for p in group["params"]} == {
        id(p)
        for p in critic.parameters()
        if p.requires_grad
        # AdamW holds the adapters' state only
    }
    base = load_weights(Path(tiny_assets["model"]) / "model.safetensors")
    q = critic.backbone.get_base_model().layers[0].self_attn.q_proj.base_layer.weight
    torch.testing.assert_close(q.float(), base["model.layers.0.self_attn.q_proj.weight"].float())

    bad = load_config(tiny_config, {**overrides, "critic.model.target_modules": ["q_proj"]})
    with pytest.raises(KeelError) as error:
        RoleWorker(WorkerSpec.of(bad, total_steps=2))
    assert error.value.code == LORA_TARGETS and "critic.model" in error.value.message


def test_a_ppo_run_with_lora_on_both_models_learns_values(tiny_config):
    cfg = lora_config(tiny_config)
    cfg["algorithm"] = {**cfg.get("algorithm", {}), "adv_estimator": "gae"}
    cfg["critic"] = {
        **cfg.get("critic", {}),
        "model": {"lora_rank": 4, "lora_alpha": 8},
        "optim": {"lr": 1e-2},
    }
    cfg["trainer"]["total_training_steps"] = 3
    steps = metrics(train(cfg).run_dir)
    assert len(steps) == 3 and all(math.isfinite(m["critic/vf_loss"]) for m in steps)
    # the value head and adapters learn
    assert steps[-1]["critic/vf_loss"] < steps[0]["critic/vf_loss"]


@pytest.mark.parametrize(
    "arch, lora",
    [
        ("qwen3", True),
        ("qwen3_moe", True),
        ("qwen3_moe", False),
        ("gemma3_text", True),
        ("gemma3_text", False),
        ("olmo2", True),
        ("smollm3", False),
        ("gpt_oss", True),
        ("gpt_oss", False),
        ("phi3", True),
        ("phi3", False),
    ],
)
def test_each_native_family_trains_and_its_engine_samples_what_the_trainer_computes(
    tiny_config, tmp_path, arch, lora
):
    """Qwen3, Qwen3-MoE, Gemma 3, OLMo 2, SmolLM3, GPT-OSS and Phi-3 on the native engine through
    `keel.train`: after every update (adapters only, or every weight, experts included) the engine's
    sampled log-probs are the trainer's."""
    from keel.models.tiny import make_tiny_model

    cfg = lora_config(tiny_config) if lora else tiny_config
    cfg["actor_rollout_ref"]["model"]["path"] = str(
        make_tiny_model(tmp_path / arch, arch=arch, hidden_size=32)
    )
    cfg["actor_rollout_ref"]["rollout"]["name"] = "native"
    cfg["trainer"]["total_training_steps"] = 3
    # not the validation's
    steps = [m for m in metrics(train(cfg).run_dir) if "actor/pg_loss" in m]
    assert len(steps) == 3 and all(math.isfinite(m["actor/pg_loss"]) for m in steps)
    assert all(m["rollout/log_prob_gap"] < 1e-4 for m in steps)
