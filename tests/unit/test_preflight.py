"""keel check: what it reports on a good config, and the coded failures a user can cause."""

import json
import shutil

import pytest

from keel.check.findings import FAIL, SKIP, WARN
from keel.check.preflight import run_checks
from keel.cli import main
from keel.config.load import load_run
from keel.errors import (
    MEMORY_ESTIMATE,
    NO_EOS,
    RUN_DIR_NOT_WRITABLE,
    SCORER_RAISED,
    TOKEN_BUDGET,
    VOCAB_MISMATCH,
)


def failure_codes(report) -> list[str]:
    return [f.code for f in report.findings if f.level == FAIL]


def test_good_config_passes_with_plan_audit_and_memory(tiny_config, tmp_path, capsys):
    import yaml

    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(tiny_config))
    assert main(["check", str(config)]) == 0
    out = capsys.readouterr().out
    assert "batch plan" in out and "decided for you" in out and "memory estimate" in out
    assert "0 failed: ready to train" in out
    assert main(["check", str(config), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["memory_gb"]["total"] > 0
    assert report["audit"]["critic"] == "off" and report["plan"]["samples_per_step"] == 16
    # checking creates nothing
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "overrides, code",
    [
        # model reads 1024
        ({"data.max_prompt_length": 1000, "data.max_response_length": 100}, TOKEN_BUDGET),
        # a KV cache of petabytes
        ({"actor_rollout_ref.rollout.max_num_seqs": 10**8}, MEMORY_ESTIMATE),
    ],
)
def test_failures_before_any_weight_is_loaded(tiny_config, overrides, code):
    assert code in failure_codes(run_checks(*load_run(tiny_config, overrides)))


def test_scorer_that_raises_on_an_empty_answer(tiny_config, tmp_path):
    reward = tmp_path / "bad_reward.py"
    reward.write_text(
        "def compute_score(solution_str, ground_truth, **kwargs):\n    return 1.0 / "
        "len(solution_str)\n"
    )
    report = run_checks(*load_run(tiny_config, {"custom_reward_function.path": str(reward)}))
    assert failure_codes(report) == [SCORER_RAISED]
    assert "ZeroDivisionError" in report.failures[0].message


def test_run_dir_that_cannot_be_written(tiny_config, tmp_path):
    blocker = tmp_path / "a_file"
    # a file where a folder should be: not writable even for root
    blocker.write_text("")
    report = run_checks(*load_run(tiny_config, {"trainer.default_local_dir": str(blocker / "run")}))
    assert failure_codes(report) == [RUN_DIR_NOT_WRITABLE]


def test_tokenizer_bigger_than_the_embedding(tiny_config, tiny_assets, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_assets["model"], model)
    config = json.loads((model / "config.json").read_text())
    # the tokenizer has 260 tokens
    config["vocab_size"] = 200
    (model / "config.json").write_text(json.dumps(config))
    report = run_checks(*load_run(tiny_config, {"actor_rollout_ref.model.path": str(model)}))
    assert failure_codes(report) == [VOCAB_MISMATCH]


def test_broken_tokenizer_fails_and_dependent_checks_are_skipped(
    tiny_config, tiny_assets, tmp_path
):
    model = tmp_path / "model"
    shutil.copytree(tiny_assets["model"], model)
    tok_config = json.loads((model / "tokenizer_config.json").read_text())
    tok_config["eos_token"] = None
    (model / "tokenizer_config.json").write_text(json.dumps(tok_config))
    report = run_checks(*load_run(tiny_config, {"actor_rollout_ref.model.path": str(model)}))
    assert failure_codes(report) == [NO_EOS]
    assert {f.check for f in report.findings if f.level == SKIP} >= {
        "model",
        "data",
        "reward",
        "memory",
    }


def test_train_runs_the_check_first_and_stops_before_the_run_dir_exists(
    tiny_config, tmp_path, capsys
):
    import yaml

    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(tiny_config))
    assert (
        main(["train", str(config), "data.max_prompt_length=1000", "data.max_response_length=100"])
        == 2
    )
    assert "error[KEEL-C013]" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_per_rank_memory_shrinks_with_sharding_and_offload(tiny_config):
    one = run_checks(*load_run(tiny_config, ["trainer.device=cpu"])).memory_gb
    two = run_checks(
        *load_run(tiny_config, ["trainer.device=cpu", "trainer.n_gpus_per_node=2"])
    ).memory_gb
    offload = run_checks(
        *load_run(
            tiny_config,
            [
                "trainer.device=cpu",
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
            ],
        )
    ).memory_gb
    # 16 B/param over 2 ranks
    assert two["actor_states"] == pytest.approx(one["actor_states"] / 2, rel=0.01)
    # Adam's 8 B/param leave
    assert offload["actor_states"] == pytest.approx(two["actor_states"] / 2, rel=0.01)
    hf = run_checks(
        *load_run(
            tiny_config,
            [
                "trainer.device=cpu",
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.rollout.name=hf",
            ],
        )
    ).memory_gb
    # only hf needs a whole copy per rank
    assert "rollout_copy" in hf and "rollout_copy" not in two
    # native: its decode weights, sharded or not
    assert two["rollout_weights"] == one["rollout_weights"]


def test_a_critic_pool_is_estimated_on_its_own_devices(tiny_config):
    """Colocated, the critic's states add to the policy's devices; in a pool of its own they leave
    that total and are estimated, sharded over the pool, for the pool's devices."""
    gae = ["trainer.device=cpu", "algorithm.adv_estimator=gae"]
    colocated = run_checks(*load_run(tiny_config, gae)).memory_gb
    pooled = run_checks(
        *load_run(
            tiny_config, gae + ["critic.enable_resource_pool=true", "critic.n_gpus_per_node=2"]
        )
    ).memory_gb
    assert "critic_states" in colocated and "critic_pool" not in colocated
    assert "critic_states" not in pooled
    assert pooled["total"] == pytest.approx(
        colocated["total"] - colocated["critic_states"], rel=0.01
    )
    # + activations
    assert 0 < pooled["critic_pool"] - colocated["critic_states"] / 2 < colocated["activations"]


def test_param_offload_on_one_worker_is_a_warning_and_not_counted_as_offloaded(tiny_config):
    """verl scripts set param_offload on one GPU; keel offloads only what FSDP shards (2+ workers),
    so it says so, and estimates the weights on the device. A role that does not run is not
    named."""

    def report(*overrides):
        return run_checks(*load_run(tiny_config, ["trainer.device=cpu", *overrides]))

    plain = report()
    offload = report(
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "actor_rollout_ref.ref.fsdp_config.param_offload=true",
        # no KL term: no reference
    )
    warnings = [f.message for f in offload.findings if f.level == WARN]
    assert [w.split("=")[0] for w in warnings if "no effect on one worker" in w] == [
        "actor_rollout_ref.actor.fsdp_config.param_offload"
    ]
    assert offload.memory_gb["actor_states"] == plain.memory_gb["actor_states"] > 0


def test_memory_estimate_follows_the_resolved_compute_dtype(tiny_config):
    """dtype auto computes in float32 on CPU, so it is estimated as float32 there; bf16 halves the
    activations and the KV cache."""

    def estimate(dtype):
        return run_checks(
            *load_run(
                tiny_config,
                [
                    "trainer.device=cpu",
                    f"actor_rollout_ref.model.dtype={dtype}",
                    "actor_rollout_ref.rollout.max_num_seqs=100000",
                ],
            )
        ).memory_gb

    auto, fp32, bf16 = estimate("auto"), estimate("float32"), estimate("bfloat16")
    assert auto == fp32
    assert bf16["kv_cache"] == pytest.approx(fp32["kv_cache"] / 2, rel=0.01)
    # the native engine's own decode weights count
    assert "rollout_weights" in fp32


def test_a_ray_address_where_nothing_answers_is_refused_at_once(tiny_config, monkeypatch):
    import socket

    from keel.errors import RAY_MISSING

    # a port that was free a moment ago: nothing listens there
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    report = run_checks(*load_run(tiny_config, ["trainer.device=cpu", "trainer.n_gpus_per_node=2"]))
    assert RAY_MISSING in failure_codes(report)
    assert any(
        f"RAY_ADDRESS=127.0.0.1:{port}" in f.message
        for f in report.findings
        if f.code == RAY_MISSING
    )


def test_more_nodes_than_a_local_ray_instance_has_is_refused(tiny_config, monkeypatch):
    from keel.errors import NOT_ENOUGH_DEVICES

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    report = run_checks(*load_run(tiny_config, ["trainer.device=cpu", "trainer.nnodes=2"]))
    assert NOT_ENOUGH_DEVICES in failure_codes(report)
    assert any("RAY_ADDRESS" in f.fix for f in report.findings if f.code == NOT_ENOUGH_DEVICES)


@pytest.mark.parametrize(
    "value, said",
    [
        ("http", "not a port number"),
        ("70000", "not a port number"),
        ("TAKEN", "is taken on rank 0's node"),
    ],
)
def test_a_master_port_keel_cannot_use_is_refused_not_ignored(
    tiny_config, monkeypatch, value, said
):
    import socket

    from keel.errors import MASTER_PORT_UNUSABLE

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        monkeypatch.setenv(
            "MASTER_PORT", str(taken.getsockname()[1]) if value == "TAKEN" else value
        )
        report = run_checks(
            *load_run(tiny_config, ["trainer.device=cpu", "trainer.n_gpus_per_node=2"])
        )
    assert failure_codes(report) == [MASTER_PORT_UNUSABLE]
    assert any(said in f.message for f in report.findings if f.code == MASTER_PORT_UNUSABLE)


def test_a_free_master_port_is_where_rank_0_listens(tiny_config, monkeypatch):
    from keel.distributed.dist import free_port

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    port = free_port()
    monkeypatch.setenv("MASTER_PORT", str(port))
    report = run_checks(*load_run(tiny_config, ["trainer.device=cpu", "trainer.n_gpus_per_node=2"]))
    assert not report.failures
    assert any(f"MASTER_PORT={port}" in f.message for f in report.findings if f.check == "workers")


def _retokenized(tiny_assets, tmp_path, **tokens) -> str:
    """The tiny model with its tokenizer's special tokens changed, as another model's would be."""
    model = tmp_path / "model"
    shutil.copytree(tiny_assets["model"], model)
    tok_config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**tok_config, **tokens}))
    return str(model)


def test_a_tokenizer_whose_eos_the_model_does_not_end_with_is_a_warning_with_the_fix(
    tiny_config, tiny_assets, tmp_path
):
    from keel.errors import TOKENIZER_MISMATCH

    # what transformers fills in for Qwen2
    path = _retokenized(tiny_assets, tmp_path, eos_token="<|endoftext|>")
    report = run_checks(*load_run(tiny_config, {"actor_rollout_ref.model.path": path}))
    assert not report.failures
    warned = [f for f in report.findings if f.code == TOKENIZER_MISMATCH]
    assert (
        len(warned) == 1
        and "'<|endoftext|>'" in warned[0].message
        and "'<|im_end|>'" in warned[0].message
    )
    assert f'set `"eos_token": "<|im_end|>"` in `{path}/tokenizer_config.json`' in warned[0].fix


def test_a_tokenizer_from_another_model_is_refused(tiny_config, tiny_assets, tmp_path):
    from keel.errors import TOKENIZER_MISMATCH

    path = _retokenized(tiny_assets, tmp_path, eos_token="<|endoftext|>", pad_token="<|im_start|>")
    report = run_checks(*load_run(tiny_config, {"actor_rollout_ref.model.path": path}))
    assert failure_codes(report) == [TOKENIZER_MISMATCH]
    assert "EOS" in report.failures[0].message and "PAD" in report.failures[0].message


def test_a_budget_over_the_models_positions_is_not_fixed_by_max_model_len(tiny_config):
    report = run_checks(
        *load_run(tiny_config, {"data.max_prompt_length": 1000, "data.max_response_length": 100})
    )
    failure = report.failures[0]
    # 1000 + 24 = 1024
    assert failure.code == TOKEN_BUDGET and "`data.max_response_length=24`" in failure.fix
    assert "cannot go past" in failure.fix and "raise rollout.max_model_len" not in failure.fix


def test_weights_under_other_names_are_a_warning_that_says_what_would_start_random(
    tiny_config, tiny_assets, tmp_path
):
    from safetensors.torch import load_file, save_file

    from keel.errors import WEIGHTS_BROKEN

    model = tmp_path / "model"
    shutil.copytree(tiny_assets["model"], model)
    tensors = load_file(model / "model.safetensors")
    save_file(
        {name.replace("model.layers.0.", "decoder.block.0."): t for name, t in tensors.items()},
        model / "model.safetensors",
        metadata={"format": "pt"},
    )
    report = run_checks(*load_run(tiny_config, {"actor_rollout_ref.model.path": str(model)}))
    assert not report.failures
    warned = [f for f in report.findings if f.code == WEIGHTS_BROKEN]
    assert (
        len(warned) == 1
        and "model.layers.0." in warned[0].message
        and "random" in warned[0].message
    )


def sliding_window_qwen2(path):
    """A model the native engine cannot run: Qwen2 with its sliding window on (the fused decode step
    of Llama-shaped families has no window)."""
    from keel.models.tiny import make_tiny_model

    model = make_tiny_model(path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(
        json.dumps({**config, "use_sliding_window": True, "sliding_window": 16})
    )
    return model


@pytest.mark.parametrize(
    "arch, engine",
    [
        ("qwen3", "native"),
        ("qwen3_moe", "native"),
        ("gemma3_text", "native"),
        ("olmo2", "native"),
        ("smollm3", "native"),
        ("phi3", "native"),
        ("gpt_oss", "hf"),
        ("qwen2 with a sliding window", "hf"),
    ],
)
def test_the_rollout_engine_is_named_and_a_fallback_to_hf_says_what_it_costs(
    tiny_config, tmp_path, arch, engine
):
    """Checkpoints transformers writes itself pass the weights check (a mixture's stacked experts
    are not 'missing tensors'); a model the native engine cannot run is a warning with its cost."""
    from keel.models.tiny import make_tiny_model

    sliding = arch.startswith("qwen2 ")
    model = (
        sliding_window_qwen2(tmp_path / "m")
        if sliding
        else make_tiny_model(tmp_path / arch, arch=arch)
    )
    report = run_checks(*load_run(tiny_config, {"actor_rollout_ref.model.path": str(model)}))
    assert failure_codes(report) == []
    [finding] = [f for f in report.findings if f.check == "rollout engine"]
    assert finding.message.startswith(engine)
    assert (finding.level == WARN) == (engine == "hf")
    if engine == "hf":
        assert ("sliding-window" if sliding else "rollout.name=native runs it") in finding.message
        assert "slower" in finding.message and "H200" in finding.message
    assert not [f for f in report.findings if f.check == "model" and f.level == WARN]


def test_native_named_for_a_family_it_cannot_run_is_refused_by_keel_check(tiny_config, tmp_path):
    from keel.errors import INCOMPATIBLE_OPTIONS

    model = sliding_window_qwen2(tmp_path / "m")
    report = run_checks(
        *load_run(
            tiny_config,
            {
                "actor_rollout_ref.model.path": str(model),
                "actor_rollout_ref.rollout.name": "native",
            },
        )
    )
    assert failure_codes(report) == [INCOMPATIBLE_OPTIONS]
    assert "rollout.name=hf" in report.failures[0].fix


def test_an_eos_token_transformers_adds_on_load_is_refused(tiny_config, tiny_assets, tmp_path):
    """tokenizer_config.json names an eos_token the vocabulary lacks: transformers gives it a new id
    without a word, a row the model never trained. keel check stops with the token to write."""
    from keel.errors import EOS_ADDED_ON_LOAD

    model = tmp_path / "model"
    shutil.copytree(tiny_assets["model"], model)
    tok_config = json.loads((model / "tokenizer_config.json").read_text())
    tok_config["eos_token"] = "<|end_of_turn|>"
    (model / "tokenizer_config.json").write_text(json.dumps(tok_config))
    report = run_checks(*load_run(tiny_config, {"actor_rollout_ref.model.path": str(model)}))
    assert failure_codes(report) == [EOS_ADDED_ON_LOAD]
    assert (
        "<|end_of_turn|>" in report.failures[0].message and "<|im_end|>" in report.failures[0].fix
    )


def test_a_rollout_on_workers_of_its_own_is_estimated_on_its_own_devices(tiny_config):
    """hybrid_engine=false: the engine's decode weights and KV cache leave the actor's devices and
    are estimated, as rollout_pool, for the rollout's."""
    cpu = ["trainer.device=cpu"]
    colocated = run_checks(*load_run(tiny_config, cpu)).memory_gb
    apart = run_checks(
        *load_run(tiny_config, cpu + ["actor_rollout_ref.hybrid_engine=false"])
    ).memory_gb
    engine = colocated["kv_cache"] + colocated["rollout_weights"]
    assert "kv_cache" not in apart and "rollout_weights" not in apart
    assert apart["total"] == pytest.approx(colocated["total"] - engine, rel=0.01)
    assert apart["rollout_pool"] == pytest.approx(engine, rel=0.01)


def test_an_hf_rollout_of_its_own_is_one_whole_model_on_its_devices(tiny_config):
    """hf on 2 sharded workers: colocated, each actor rank holds a whole float32 copy for
    generating; with the rollout apart, that copy is the rollout's own model, counted once there."""
    hf = ["trainer.device=cpu", "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.name=hf"]
    colocated = run_checks(*load_run(tiny_config, hf)).memory_gb
    apart = run_checks(
        *load_run(tiny_config, hf + ["actor_rollout_ref.hybrid_engine=false"])
    ).memory_gb
    assert "rollout_copy" not in apart
    assert apart["rollout_pool"] == pytest.approx(
        colocated["kv_cache"] + colocated["rollout_copy"], rel=0.01
    )
