"""`keel train` end to end on a tiny model: what a user checks after a run."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from keel.cli import main

ESTIMATORS = ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"]
EXPECTED_KEYS = [
    "actor/pg_loss",
    "actor/entropy",
    "actor/ppo_kl",
    "actor/pg_clipfrac",
    "actor/grad_norm",
    "critic/score/mean",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "response_length/mean",
    "response_length/clip_ratio",
    "timing_s/gen",
    "timing_s/update_actor",
    "timing_s/step",
    "perf/throughput",
]


def write_config(cfg: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """A model directory's weights, or a LoRA checkpoint's adapters."""
    adapter = model_dir / "adapter_model.safetensors"
    return load_file(adapter if adapter.exists() else model_dir / "model.safetensors")


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_each_estimator_trains_two_steps(estimator, tiny_config, tiny_assets, tmp_path):
    tiny_config["algorithm"]["adv_estimator"] = estimator
    if estimator == "reinforce_plus_plus":
        tiny_config["actor_rollout_ref"]["rollout"]["n"] = 1
        tiny_config["actor_rollout_ref"]["actor"]["ppo_micro_batch_size_per_gpu"] = 2
    config = write_config(tiny_config, tmp_path / "cfg.yaml")

    assert main(["train", str(config)]) == 0

    run_dir = Path(tiny_config["trainer"]["default_local_dir"])
    steps = [m for m in read_metrics(run_dir) if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2]
    expected = EXPECTED_KEYS + (
        ["critic/vf_loss", "critic/values/mean"] if estimator == "gae" else []
    )
    for record in steps:
        missing = [k for k in expected if k not in record]
        assert not missing, f"{estimator}: metrics missing {missing}"
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in record.values()), (
            record
        )
    # validation before training
    assert "val/digits/acc" in read_metrics(run_dir)[0]

    before, after = weights(tiny_assets["model"]), weights(run_dir / "global_step_2" / "actor")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, f"{estimator}: no parameter changed after 2 steps"


@pytest.mark.parametrize(
    "overrides",
    [
        # PPO with KL in the reward (adaptive controller), dual-clip and clip-higher (DAPO)
        {
            "algorithm": {
                "adv_estimator": "gae",
                "use_kl_in_reward": True,
                "kl_ctrl": {"type": "adaptive"},
            },
            "actor_rollout_ref": {
                "actor": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "ppo_epochs": 2}
            },
        },
        # GRPO with a KL loss and an entropy bonus; Dr. GRPO's unnormalised advantages and
        # aggregation
        {
            "algorithm": {"norm_adv_by_std_in_grpo": False},
            "actor_rollout_ref": {
                "actor": {
                    "use_kl_loss": True,
                    "kl_loss_type": "low_var_kl",
                    "entropy_coeff": 0.01,
                    "loss_agg_mode": "seq-mean-token-sum-norm",
                }
            },
        },
        # GSPO's sequence-level ratio
        {
            "actor_rollout_ref": {
                "actor": {
                    "policy_loss": {"loss_mode": "gspo"},
                    "clip_ratio_low": 3e-4,
                    "clip_ratio_high": 4e-4,
                    "loss_agg_mode": "seq-mean-token-mean",
                }
            }
        },
    ],
    ids=["ppo-kl-in-reward", "dr-grpo-kl-loss", "gspo"],
)
def test_algorithm_variants_train(overrides, tiny_config, monkeypatch):
    from keel.config.load import flatten, load_config
    from keel.trainer.rl import RLTrainer
    from keel.training import actor

    # the policy loss and its parameters, as the actor really calls them
    used = []
    real_loss = actor.compute_policy_loss
    monkeypatch.setattr(
        actor,
        "compute_policy_loss",
        lambda name, *args, **kw: used.append((name, args[-1])) or real_loss(name, *args, **kw),
    )
    cfg = load_config(tiny_config, flatten(overrides))
    result = RLTrainer(cfg).fit()

    assert result.last_step == 2
    assert all(math.isfinite(v) for v in result.last_metrics.values())
    name, params = used[-1]
    a = cfg.actor_rollout_ref.actor
    assert name == a.policy_loss.loss_mode
    assert (params.clip_ratio_low, params.clip_ratio_high) == (
        a.clip_ratio_low or a.clip_ratio,
        a.clip_ratio_high or a.clip_ratio,
    )
    assert (
        params.loss_agg_mode == a.loss_agg_mode
        and params.norm_length == cfg.data.max_response_length
    )
    if cfg.ref_enabled:
        assert "actor/ref_kl" in result.last_metrics
    if a.use_kl_loss:
        assert "actor/kl_loss" in result.last_metrics
    if cfg.algorithm.use_kl_in_reward:
        assert "actor/reward_kl_penalty_coeff" in result.last_metrics


@pytest.mark.parametrize(
    "variant",
    [
        # GRPO
        {},
        # PPO: critic weights and optimiser, the adaptive KL controller and two epochs must all
        # resume ... and the reward normaliser's window
        {
            "algorithm": {
                "adv_estimator": "gae",
                "use_kl_in_reward": True,
                "kl_ctrl": {"type": "adaptive"},
            },
            "actor_rollout_ref": {"actor": {"ppo_epochs": 2}},
            "reward": {"normalize": {"enable": True}},
        },
        # LoRA: the adapters and their optimiser state resume, the base is reloaded from model.path
        {
            "actor_rollout_ref": {
                "model": {"lora_rank": 8},
                "actor": {"use_kl_loss": True, "optim": {"lr": 2e-2}},
            }
        },
    ],
    ids=["grpo", "ppo-adaptive-kl-norm", "lora"],
)
def test_resume_after_stop_matches_uninterrupted_run(variant, tiny_config, tmp_path, monkeypatch):
    from keel.api import train
    from keel.trainer import rl

    tiny_config = _merge(tiny_config, variant)
    tiny_config["trainer"].update({"total_training_steps": 4, "save_freq": 2, "test_freq": -1})
    # schedule state matters
    tiny_config["actor_rollout_ref"]["actor"]["optim"]["warmup_style"] = "cosine"
    straight = dict(
        tiny_config, trainer={**tiny_config["trainer"], "default_local_dir": str(tmp_path / "a")}
    )
    stopped = dict(
        tiny_config, trainer={**tiny_config["trainer"], "default_local_dir": str(tmp_path / "b")}
    )
    train(straight)

    real_step = rl.RLTrainer.train_step

    def stop_at_step_3(self, logger):
        if self.step == 3:
            # the user pressed Ctrl-C during step 3
            raise KeyboardInterrupt
        return real_step(self, logger)

    monkeypatch.setattr(rl.RLTrainer, "train_step", stop_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        train(stopped)
    monkeypatch.setattr(rl.RLTrainer, "train_step", real_step)
    assert (tmp_path / "b" / "latest_checkpointed_iteration.txt").read_text() == "2"
    # resume_mode=auto picks up global_step_2
    train(stopped)

    a, b = (
        weights(tmp_path / "a" / "global_step_4" / "actor"),
        weights(tmp_path / "b" / "global_step_4" / "actor"),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    metrics_a, metrics_b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [m["step"] for m in metrics_b] == [0, 1, 2, 3, 4]
    for ma, mb in zip(metrics_a, metrics_b):
        assert _numerics(ma) == _numerics(mb)


def _merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(base.get(key, {}), value) if isinstance(value, dict) else value
    return merged


def _numerics(record: dict) -> dict:
    """Everything but wall-clock measurements."""
    return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "perf/"))}


def test_misspelt_key_fails_fast_and_creates_no_run_dir(tiny_config, tmp_path):
    config = write_config(tiny_config, tmp_path / "cfg.yaml")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "keel",
            "train",
            str(config),
            "actor_rollout_ref.actor.ppo_mini_batch_szie=4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "error[KEEL-C001]" in proc.stderr
    assert "ppo_mini_batch_size" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not Path(tiny_config["trainer"]["default_local_dir"]).exists()


def test_exported_checkpoint_loads_and_generates(tiny_config, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = write_config(tiny_config, tmp_path / "cfg.yaml")
    assert main(["train", str(config)]) == 0
    out = tmp_path / "exported"
    assert (
        main(
            [
                "export",
                str(Path(tiny_config["trainer"]["default_local_dir"]) / "global_step_2"),
                str(out),
            ]
        )
        == 0
    )

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    inputs = tokenizer("Digits please: 7", return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] > inputs["input_ids"].shape[1]


@pytest.mark.parametrize(
    "change",
    [
        {"data.train_batch_size": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 1},
        # the optimiser state would silently keep the old lr
        {"actor_rollout_ref.actor.optim.lr": 1e-6},
    ],
)
def test_resume_with_different_settings_is_refused(change, tiny_config):
    from keel.api import train
    from keel.errors import RESUME_MISMATCH, KeelError

    train(tiny_config)
    run_dir = Path(tiny_config["trainer"]["default_local_dir"])
    before = {name: (run_dir / name).read_text() for name in ("metrics.jsonl", "config.yaml")}
    with pytest.raises(KeelError) as info:
        train(tiny_config, {**change, "trainer.total_training_steps": 4})
    assert info.value.code == RESUME_MISMATCH
    assert next(iter(change)) in info.value.message
    # the run directory is untouched
    assert {name: (run_dir / name).read_text() for name in before} == before


def test_checkpoint_from_an_older_keel_resumes_and_may_switch_engine(tiny_config):
    """A config saved before a key existed resumes when the key holds its default; the rollout
    engine may change between runs (it does not change the algorithm)."""
    import yaml

    from keel.api import train

    train(tiny_config)
    saved = Path(tiny_config["trainer"]["default_local_dir"]) / "global_step_2" / "config.yaml"
    old = yaml.safe_load(saved.read_text())
    # as a keel without that key wrote it
    del old["actor_rollout_ref"]["rollout"]["ignore_eos"]
    saved.write_text(yaml.safe_dump(old))
    result = train(
        tiny_config, {"trainer.total_training_steps": 3, "actor_rollout_ref.rollout.name": "hf"}
    )
    assert result.last_step == 3


def test_bf16_compute_keeps_float32_master_weights_that_move_at_small_lr(tiny_config, tiny_assets):
    """At RL learning rates an update is far below bf16's resolution; float32 master weights keep
    it."""
    from keel.api import train

    tiny_config["actor_rollout_ref"]["model"]["dtype"] = "bfloat16"
    tiny_config["actor_rollout_ref"]["actor"]["optim"]["lr"] = 1e-6
    result = train(tiny_config)

    before, after = (
        weights(tiny_assets["model"]),
        weights(result.run_dir / "global_step_2" / "actor"),
    )
    assert all(t.dtype == torch.float32 for t in after.values())
    changed = sum(int((before[k] != after[k]).sum()) for k in before)
    total = sum(t.numel() for t in before.values())
    assert changed / total > 0.5, f"only {changed}/{total} weights moved"


def test_new_run_over_old_checkpoints_is_refused_and_extending_a_run_is_allowed(tiny_config):
    from keel.api import train
    from keel.errors import RESUME_MISMATCH, KeelError

    train(tiny_config)
    with pytest.raises(KeelError) as info:
        train(tiny_config, {"trainer.resume_mode": "disable"})
    assert info.value.code == RESUME_MISMATCH and "global_step_2" in info.value.message

    # more steps, a new save frequency and pruning are fine: the same run, continued
    result = train(
        tiny_config,
        {
            "trainer.total_training_steps": 4,
            "trainer.save_freq": 1,
            "trainer.max_actor_ckpt_to_keep": 1,
        },
    )
    assert result.last_step == 4
    assert [p.name for p in result.run_dir.glob("global_step_*")] == ["global_step_4"]


def test_user_hook_adds_metrics_and_guards_are_logged(tiny_config, tmp_path, monkeypatch):
    from keel.api import train

    (tmp_path / "my_hooks.py").write_text(
        "def longest(step, metrics, batch):\n"
        "    metrics['custom/longest_response'] = float(batch.response_lengths.max())\n"
        "    return [f'hook saw step {step}']\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    result = train(tiny_config, {"trainer.hooks": ["my_hooks:longest"]})
    steps = [m for m in read_metrics(result.run_dir) if m["step"] > 0]
    assert all("custom/longest_response" in m and m["guards/warnings"] >= 1 for m in steps)
    assert all("guards/frac_reward_zero_std" in m for m in steps)


def test_nonfinite_log_probs_stop_or_skip_the_step(tiny_config, monkeypatch):
    from keel.api import train
    from keel.errors import NONFINITE_VALUES, KeelError
    from keel.training.actor import ActorTrainer

    real = ActorTrainer.compute_log_probs
    monkeypatch.setattr(
        ActorTrainer, "compute_log_probs", lambda self, batch: real(self, batch) * float("nan")
    )
    with pytest.raises(KeelError) as info:
        train(tiny_config)
    assert info.value.code == NONFINITE_VALUES and "actor log-probs" in info.value.message

    tiny_config["trainer"]["default_local_dir"] += "_skip"
    result = train(tiny_config, {"trainer.guards.nonfinite": "skip"})
    assert [
        m.get("guards/skipped_steps") for m in read_metrics(result.run_dir) if m["step"] > 0
    ] == [1.0, 2.0]


def test_nan_rewards_stop_or_skip_the_step(tiny_config, tmp_path):
    """One NaN score is a not-scored sample (reward.on_error); a batch of them stops the run with
    R006, or under trainer.guards.nonfinite=skip drops the step, counted."""
    from keel.api import train
    from keel.errors import TOO_MANY_NOT_SCORED, KeelError

    nan_scorer = tmp_path / "nan_reward.py"
    nan_scorer.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    # fine on the rows keel check tries (the answer, an empty response); NaN on rollouts\n"
        "    return 1.0 if solution_str in (str(ground_truth), '') else float('nan')\n"
    )
    overrides = {"custom_reward_function.path": str(nan_scorer), "trainer.val_before_train": False}
    with pytest.raises(KeelError) as info:
        train(tiny_config, overrides)
    assert info.value.code == TOO_MANY_NOT_SCORED and "not a number: nan" in info.value.message

    tiny_config["trainer"]["default_local_dir"] += "_skip"
    result = train(
        tiny_config, {**overrides, "trainer.guards.nonfinite": "skip", "trainer.test_freq": -1}
    )
    steps = [m for m in read_metrics(result.run_dir) if m["step"] > 0]
    assert [m.get("guards/skipped_steps") for m in steps] == [1.0, 2.0]
    # no update
    assert "actor/pg_loss" not in steps[0]


def test_gradients_cut_from_the_weights_stop_the_run(tiny_config, monkeypatch):
    from keel.api import train
    from keel.distributed import roles
    from keel.errors import NO_GRADIENT, KeelError

    real = roles.load_causal_lm

    # e.g. a wrapper that left every weight frozen
    def frozen(*args, **kwargs):
        return real(*args, **kwargs).requires_grad_(False)

    monkeypatch.setattr(roles, "load_causal_lm", frozen)
    with pytest.raises(KeelError) as info:
        train(tiny_config)
    assert info.value.code == NO_GRADIENT


def test_weighted_scorers_and_overlong_penalty_in_a_run(tiny_config):
    from keel.api import train

    result = train(
        tiny_config,
        {
            "reward.scorers": {"digits": {"custom": 0.8, "think_answer_format": 0.2}},
            "reward.overlong_buffer.enable": True,
            "reward.overlong_buffer.len": 4,
        },
    )
    last = result.last_metrics
    assert {
        "reward/custom/mean",
        "reward/think_answer_format/mean",
        "reward/overlong_penalty/mean",
    } <= set(last)
    assert last["reward/overlong_penalty/mean"] <= 0.0


def test_samples_the_scorer_fails_on_leave_the_update_and_are_counted(tiny_config, tmp_path):
    from keel.api import train

    scorer = tmp_path / "flaky.py"
    scorer.write_text(
        "def compute_score(solution_str, **kwargs):\n"
        "    s = solution_str\n"
        "    if len(s) > 3 and sum(map(ord, s)) % 4 == 0:  # real rows and '' score fine\n"
        "        raise ValueError('cannot parse')\n"
        "    return (sum(map(ord, s)) % 7) / 6\n"
    )
    result = train(
        tiny_config,
        {
            "custom_reward_function.path": str(scorer),
            "reward.max_not_scored_ratio": 0.9,
            "trainer.val_before_train": False,
            "trainer.test_freq": -1,
        },
    )
    steps = [m for m in read_metrics(result.run_dir) if m["step"] > 0]
    assert len(steps) == 2 and all(math.isfinite(m["actor/pg_loss"]) for m in steps)
    assert sum(m["reward/not_scored_ratio"] for m in steps) > 0
    assert sum(m.get("reward/not_scored/raised_ValueError", 0) for m in steps) > 0


def test_a_torch_compile_failure_names_the_switch_that_avoids_it(
    tiny_config, tmp_path, monkeypatch, capsys
):
    """The layers compile (as on a GPU) with a backend that fails, as inductor can on an unusual
    model or release: the run stops with KEEL-E009 and the key that turns compilation off, not
    with a compiler traceback alone; with that key set the same run trains."""
    from keel.distributed import parallelize, roles
    from keel.distributed.parallelize import block_modules

    def failing_backend(graph_module, example_inputs):
        raise RuntimeError("inductor: unsupported op in this release")

    def compile_with_failing_backend(model):
        for block in block_modules(model):
            block.forward = torch.compile(block.forward, backend=failing_backend)

    monkeypatch.setattr(roles, "can_compile", lambda device: True)
    monkeypatch.setattr(parallelize, "compile_blocks", compile_with_failing_backend)
    tiny_config["trainer"]["total_training_steps"] = 1
    assert main(["train", str(write_config(tiny_config, tmp_path / "cfg.yaml"))]) != 0
    err = capsys.readouterr().err
    assert "KEEL-E009" in err and "unsupported op" in err and "use_torch_compile=false" in err
    tiny_config["actor_rollout_ref"]["actor"]["use_torch_compile"] = False
    tiny_config["trainer"]["default_local_dir"] = str(tmp_path / "second")
    assert main(["train", str(write_config(tiny_config, tmp_path / "cfg2.yaml"))]) == 0


def test_the_first_mini_batch_takes_its_own_forward_as_old_and_trains_the_same(
    tiny_config, monkeypatch
):
    """Several mini-batches: the first runs before any optimiser step, so the pass skips its samples
    and the update's forward gives their old log-probs. Losses, gradients and weights equal the run
    whose pass computes every sample; the gap and reference KL are measured on the rest."""
    from keel.api import train
    from keel.trainer.roles import WorkerRoles

    computed = []
    original = WorkerRoles.actor_log_probs
    monkeypatch.setattr(
        WorkerRoles,
        "actor_log_probs",
        lambda self, batch: computed.append(len(batch)) or original(self, batch),
    )
    tiny_config["actor_rollout_ref"]["actor"].update({"use_kl_loss": True, "kl_loss_coef": 0.1})
    # 4 prompts x 4 samples, mini-batches of 2 prompts
    skipped = train(tiny_config)
    # half of each step's 16 samples
    assert computed == [8, 8]
    monkeypatch.setattr(WorkerRoles, "first_mini_batch", lambda self, batch, seed: None)
    tiny_config["trainer"]["default_local_dir"] += "_with_pass"
    recomputed = train(tiny_config)
    assert computed[2:] == [16, 16]
    ours, theirs = (
        [m for m in read_metrics(r.run_dir) if m["step"] > 0] for r in (skipped, recomputed)
    )
    for a, b in zip(ours, theirs):
        for key in (
            "actor/pg_loss",
            "actor/grad_norm",
            "actor/kl_loss",
            "actor/entropy",
            "critic/score/mean",
        ):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        # measured on the recomputed half: the engine agrees with the trainer to float32 rounding,
        # which on CPU can be exactly 0 (its prefill is bitwise the trainer's forward), so the bound
        # is what is checked
        assert 0 <= a["rollout/log_prob_gap"] < 1e-4 and math.isfinite(a["actor/ref_kl"])
        assert (a["perf/old_log_prob_samples"], b["perf/old_log_prob_samples"]) == (8, 16)
    # after an update the policy has moved from the reference
    assert ours[-1]["actor/ref_kl"] > 1e-4
    final = lambda result: weights(sorted(Path(result.run_dir).glob("global_step_*"))[-1] / "actor")  # noqa: E731
    for name, tensor in final(skipped).items():
        torch.testing.assert_close(tensor, final(recomputed)[name], rtol=1e-5, atol=1e-6)


def test_an_on_policy_update_skips_the_old_log_prob_pass_and_trains_the_same(
    tiny_config, monkeypatch
):
    """One mini-batch and one epoch: the update's own forward is the old policy's, so the trainer
    skips the pass that recomputes it. The run's numbers (losses, gradient norm, the engine's gap,
    the reference KL) and its weights equal those of the same run with the pass."""
    from keel.api import train
    from keel.trainer.roles import WorkerRoles

    # the whole batch of 4 prompts
    tiny_config["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] = 4
    tiny_config["actor_rollout_ref"]["actor"].update({"use_kl_loss": True, "kl_loss_coef": 0.1})
    skipped = train(tiny_config)
    # the whole pass
    monkeypatch.setattr(WorkerRoles, "first_mini_batch", lambda self, batch, seed: None)
    tiny_config["trainer"]["default_local_dir"] += "_with_pass"
    recomputed = train(tiny_config)
    ours, theirs = (
        [m for m in read_metrics(r.run_dir) if m["step"] > 0] for r in (skipped, recomputed)
    )
    assert all("timing_s/old_log_prob" not in m for m in ours) and all(
        "timing_s/old_log_prob" in m for m in theirs
    )
    for a, b in zip(ours, theirs):
        for key in (
            "actor/pg_loss",
            "actor/grad_norm",
            "actor/kl_loss",
            "actor/ref_kl",
            "rollout/log_prob_gap",
            "actor/entropy",
            "critic/score/mean",
        ):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    # numbers that could differ
    assert a["rollout/log_prob_gap"] > 0 and a["actor/grad_norm"] > 0
    final = lambda result: weights(sorted(Path(result.run_dir).glob("global_step_*"))[-1] / "actor")  # noqa: E731
    for name, tensor in final(skipped).items():
        torch.testing.assert_close(tensor, final(recomputed)[name], rtol=1e-5, atol=1e-6)
