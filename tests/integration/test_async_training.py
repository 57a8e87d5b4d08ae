"""trainer.mode=async on CPU: with a bound of 0 it is the synchronous run exactly; with a bound of k
no trained sample is more than k policy versions old, and rollout correction is on; rewards score
while the next batch generates; a resumed run neither loses nor repeats a prompt."""

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from keel.api import train
from keel.trainer import ahead, rl
from keel.trainer.scored_rollout import ScoredRollout


def run_config(tiny_config, tmp_path: Path, name: str, **trainer) -> dict:
    steps = trainer.pop("steps", 4)
    settings = {
        "total_training_steps": steps,
        "save_freq": steps,
        "test_freq": -1,
        "val_before_train": False,
    }
    return dict(
        tiny_config,
        trainer={
            **tiny_config["trainer"],
            **settings,
            **trainer,
            "default_local_dir": str(tmp_path / name),
        },
    )


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def numerics(record: dict) -> dict:
    """What must match between runs: not wall-clock times, not async mode's own counts, and not how
    much scoring began beside generation (async mode scores in processes, which can)."""
    skipped = ("timing_s/", "perf/", "async/", "reward/scored_ahead")
    return {k: v for k, v in record.items() if not k.startswith(skipped)}


@pytest.fixture
def trained_batches(monkeypatch):
    """Per step trained: (the step, its samples' policy versions, its prompts' dataset indices)."""
    seen = []
    for kind in (ahead.RolloutWithin, ahead.RolloutAhead):

        def recording(self, timer, step, real=kind.__call__):
            samples = real(self, timer, step)
            batch = samples.batch
            seen.append(
                (
                    step,
                    sorted(set(batch.policy_version.tolist())),
                    sorted({r.index for r in batch.records}),
                )
            )
            return samples

        monkeypatch.setattr(kind, "__call__", recording)
    return seen


def test_async_with_a_bound_of_0_is_the_synchronous_run_exactly(
    tiny_config, tmp_path, trained_batches
):
    sync = train(run_config(tiny_config, tmp_path, "sync")).run_dir
    sync_batches = list(trained_batches)
    trained_batches.clear()
    ahead = train(
        run_config(tiny_config, tmp_path, "async", mode="async", max_off_policy_steps=0)
    ).run_dir
    # the same prompts, each from the policy before its step
    assert trained_batches == sync_batches
    a, b = (
        load_file(run / "global_step_4" / "actor" / "model.safetensors") for run in (sync, ahead)
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [numerics(m) for m in metrics_of(sync)] == [numerics(m) for m in metrics_of(ahead)]
    assert all(
        m["async/staleness/max"] == 0 for m in metrics_of(ahead) if "async/staleness/max" in m
    )


def test_with_a_bound_of_k_no_trained_sample_is_more_than_k_versions_old(
    tiny_config, tmp_path, trained_batches
):
    run_dir = train(
        run_config(tiny_config, tmp_path, "k2", steps=5, mode="async", max_off_policy_steps=2)
    ).run_dir
    steps = [m for m in metrics_of(run_dir) if m["step"] > 0]
    for (step, versions, _), m in zip(trained_batches, steps):
        # batch i is generated at step max(1, i - 2), from the policy of the updates before that
        # step
        assert versions == [max(0, step - 3)]
        assert m["async/staleness/max"] == min(step - 1, 2) <= 2
        # keel chose bypass mode: the sampler's log-probs are the old ones
        assert "timing_s/old_log_prob" not in m
    assert [s for s, _, _ in trained_batches] == [1, 2, 3, 4, 5]


def test_rewards_score_while_the_next_batch_generates(tiny_config, tmp_path, monkeypatch):
    """Batch 1's scoring waits until batch 2 is generating (an event, polled with a long limit): in
    async mode it sees it; a synchronous step would wait for its scores before generating
    anything."""
    second_batch_generating, seen = threading.Event(), []
    real_generate, real_score = ScoredRollout.generate, ScoredRollout.score
    generated = []

    def generate(self, timer, seed):
        generated.append(seed)
        if len(generated) == 2:
            second_batch_generating.set()
        return real_generate(self, timer, seed)

    def score(self, generated):
        if not seen:
            seen.append(
                (second_batch_generating.wait(timeout=300), threading.current_thread().name)
            )
        return real_score(self, generated)

    monkeypatch.setattr(ScoredRollout, "generate", generate)
    monkeypatch.setattr(ScoredRollout, "score", score)
    train(
        run_config(tiny_config, tmp_path, "overlap", steps=2, mode="async", max_off_policy_steps=1)
    )
    ((saw_it, thread),) = seen
    assert saw_it and thread.startswith("keel-scoring")


def test_an_async_run_resumed_neither_loses_nor_repeats_a_prompt(
    tiny_config, tmp_path, trained_batches, monkeypatch
):
    settings = {"mode": "async", "max_off_policy_steps": 1, "save_freq": 2}
    train(run_config(tiny_config, tmp_path, "straight", **settings))
    straight = [(prompts, versions) for _, versions, prompts in trained_batches]
    trained_batches.clear()

    real_step = rl.RLTrainer.train_step

    def stop_at_step_3(self, logger):
        if self.step == 3:
            # during step 3: batch 3 was generated at step 2, batch 4 not yet
            raise KeyboardInterrupt
        return real_step(self, logger)

    stopped = run_config(tiny_config, tmp_path, "stopped", **settings)
    monkeypatch.setattr(rl.RLTrainer, "train_step", stop_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        train(stopped)
    monkeypatch.setattr(rl.RLTrainer, "train_step", real_step)
    state = torch.load(
        tmp_path / "stopped" / "global_step_2" / "trainer_state.pt", weights_only=False
    )
    # batch 3, generated ahead at step 2
    assert state["in_flight_dropped"] == 1
    train(stopped)
    # steps 1-2, then 3-4 after the resume
    assert [s for s, _, _ in trained_batches] == [1, 2, 3, 4]
    # each once
    assert [prompts for _, _, prompts in trained_batches] == [prompts for prompts, _ in straight]
    # the resumed workers know their weights' version: batch 3 is generated again from the
    # checkpoint's weights (version 2), fresher than the straight run's (version 1), never from a
    # version 0 they do not hold
    assert [versions for _, versions in straight] == [[0], [0], [1], [2]]
    assert [versions for _, versions, _ in trained_batches] == [[0], [0], [2], [2]]


def test_keel_check_explains_the_mode_and_what_keel_decided_for_it(tiny_config):
    from keel.check.preflight import run_checks
    from keel.config.load import load_run

    tiny_config["trainer"].update({"mode": "async", "max_off_policy_steps": 2})
    report = run_checks(*load_run(tiny_config))
    assert "async: generation and scoring run up to 2 steps ahead of training" in report.plan_text
    assert "at most 2 policy versions old (rollout correction: bypass mode)" in report.plan_text
    cfg, plan = load_run(tiny_config)
    decided = plan.decided
    assert any(d.startswith("algorithm.rollout_correction.bypass_mode: true") for d in decided)
    # scored in processes beside the trainer
    assert any(d.startswith("reward.num_workers: ") for d in decided)
    assert plan.reward_workers >= 1
    # the decisions are the plan's: the config stays what the user wrote
    assert cfg.reward.num_workers == 0 and not cfg.algorithm.rollout_correction.bypass_mode
    # a correction asked off stays off
    _, off = load_run(tiny_config, {"algorithm.rollout_correction.rollout_is": None})
    assert off.rollout_correction.rollout_is is None and not off.rollout_correction.bypass_mode
    # a policy loss bypass mode cannot take gets truncated IS weights on recomputed old log-probs
    # instead
    _, gspo = load_run(tiny_config, {"actor_rollout_ref.actor.policy_loss.loss_mode": "gspo"})
    assert gspo.rollout_correction.rollout_is == "token" and not gspo.rollout_correction.bypass_mode


def test_dynamic_sampling_with_async_mode_is_refused_with_the_fix(tiny_config):
    from keel.config.load import load_config
    from keel.errors import INCOMPATIBLE_OPTIONS, KeelError

    tiny_config["trainer"]["mode"] = "async"
    tiny_config["algorithm"]["filter_groups"] = {"enable": True}
    with pytest.raises(KeelError) as refused:
        load_config(tiny_config)
    assert refused.value.code == INCOMPATIBLE_OPTIONS and "trainer.mode=sync" in refused.value.fix


def test_verls_v1_trainer_mode_is_refused_by_name_pointing_at_keels_keys(tiny_config):
    from keel.config.load import load_config
    from keel.errors import KeelError

    tiny_config["trainer"]["v1"] = {"trainer_mode": "colocate_async"}
    with pytest.raises(KeelError) as refused:
        load_config(tiny_config)
    assert (
        "trainer.v1.trainer_mode" in refused.value.message
        and "trainer.mode=async" in refused.value.message
    )


def test_async_mode_on_two_ray_workers_validates_while_a_batch_is_in_flight(tiny_config, tmp_path):
    """Two workers (Ray, on CPU) in async mode, validating every step while the next batch is
    scored: the run ends, each step after the first trains samples one version old, and validation
    scored."""
    tiny_config["trainer"].update({"total_training_steps": 3, "test_freq": 1, "mode": "async"})
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(tiny_config))
    command = [
        sys.executable,
        "-m",
        "keel",
        "train",
        str(config),
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=2",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [
        m for m in metrics_of(Path(tiny_config["trainer"]["default_local_dir"])) if m["step"] > 0
    ]
    assert [m["async/staleness/max"] for m in steps] == [0.0, 1.0, 1.0]
    assert all(any(k.startswith("val") for k in m) for m in steps)


def test_remax_in_async_mode_takes_its_baseline_from_the_policy_that_sampled_the_batch(
    tiny_config, tmp_path, monkeypatch
):
    """ReMax's greedy responses are generated right after their batch, by the same weights, and
    scored with it: with a bound of 1 the batches trained are a version old, and so are their
    baselines."""
    from keel.trainer.scored_rollout import ScoredRollout

    versions, real_score = [], ScoredRollout.score

    def score(self, generated):
        versions.append(
            (
                generated.batch.policy_version.unique().tolist(),
                generated.greedy.policy_version.tolist(),
            )
        )
        return real_score(self, generated)

    monkeypatch.setattr(ScoredRollout, "score", score)
    config = run_config(tiny_config, tmp_path, "remax", mode="async", max_off_policy_steps=1)
    config["algorithm"] = {**config["algorithm"], "adv_estimator": "remax"}
    steps = [m for m in metrics_of(train(config).run_dir) if m["step"] > 0]
    # batch 3 is generated at step 2
    assert [sampled for sampled, _ in versions] == [[0], [0], [1], [2]]
    assert all(set(greedy) == set(sampled) for sampled, greedy in versions)
    assert max(m["async/staleness/max"] for m in steps) == 1
    # steps that generated
    assert ["timing_s/gen_baseline" in m for m in steps] == [True, True, True, False]


def test_remax_with_partial_rollouts_is_refused_with_the_fix(tiny_config):
    from keel.config.load import load_config
    from keel.errors import INCOMPATIBLE_OPTIONS, KeelError

    tiny_config["trainer"].update({"mode": "async", "partial_rollout": True})
    tiny_config["algorithm"]["adv_estimator"] = "remax"
    with pytest.raises(KeelError) as refused:
        load_config(tiny_config)
    assert (
        refused.value.code == INCOMPATIBLE_OPTIONS and "partial_rollout=false" in refused.value.fix
    )


def test_a_skipped_step_leaves_the_policy_version_and_the_staleness_true(
    tiny_config, tmp_path, monkeypatch
):
    """Step 2 is skipped (trainer.guards.nonfinite=skip) before its update: step 3 trains a batch
    sampled at step 2 from version 1, and updates version 1, so it is 0 versions old; the checkpoint
    says 2 updates."""
    from keel.errors import SkipStep
    from keel.trainer.train_batch import TrainBatchBuilder

    real = TrainBatchBuilder._learning_signal

    def skip_step_2(self, scored, old, ref, values, at):
        if at.step == 2:
            raise SkipStep("advantages")
        return real(self, scored, old, ref, values, at)

    monkeypatch.setattr(TrainBatchBuilder, "_learning_signal", skip_step_2)
    config = run_config(tiny_config, tmp_path, "skip", mode="async", max_off_policy_steps=1)
    config["trainer"]["guards"] = {"nonfinite": "skip"}
    run_dir = train(config).run_dir
    steps = {m["step"]: m for m in metrics_of(run_dir)}
    assert steps[2]["guards/skipped_steps"] == 1 and "async/staleness/max" not in steps[2]
    assert steps[3]["async/staleness/max"] == 0 and steps[4]["async/staleness/max"] == 1
    state = torch.load(run_dir / "global_step_4" / "trainer_state.pt", weights_only=False)
    # steps 1, 3 and 4 updated
    assert state["policy_version"] == 3
