"""The rollout on workers of its own (actor_rollout_ref.hybrid_engine=false), two Ray workers on
CPU: one generates, one trains, and the trainer sends its weights after each update, tagged with
their policy version. In sync mode it trains the samples and losses of the colocated run; in async
mode the rollout generates the next batch while the actor trains, from weights one version old."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")

APART = ["actor_rollout_ref.hybrid_engine=false"]


def train(tiny_config: dict, tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    config = dict(
        tiny_config, trainer={**tiny_config["trainer"], "default_local_dir": str(tmp_path / name)}
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "keel", "train", str(path), "trainer.device=cpu", *overrides]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if m["step"] > 0], proc.stderr


@pytest.fixture
def config(tiny_config):
    tiny_config["trainer"].update(
        {"total_training_steps": 3, "test_freq": -1, "val_before_train": False}
    )
    return tiny_config


LEARNING = (
    "actor/pg_loss",
    "actor/grad_norm",
    "critic/score/mean",
    "response_length/mean",
    "actor/entropy",
)


def test_a_rollout_of_its_own_trains_the_colocated_runs_samples_and_losses(config, tmp_path):
    colocated, _ = train(config, tmp_path, "colocated")
    apart, log = train(config, tmp_path, "apart", *APART)
    assert "starting 1 rollout workers" in log
    # the same samples (same seeds, same weights), the same update
    for mine, theirs in zip(apart, colocated):
        for key in LEARNING:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
        # the weights went to the rollout's worker
        assert mine["timing_s/sync_rollout_weights"] > 0


def test_in_async_mode_the_rollout_of_its_own_generates_from_one_version_back(config, tmp_path):
    steps, _ = train(config, tmp_path, "async", *APART, "trainer.mode=async")
    # each version stamped by the rollout's worker as the trainer sent its weights: the first batch
    # from the starting weights, then each from the weights before the previous step's update
    assert [m["async/staleness/max"] for m in steps] == [0.0, 1.0, 1.0]
    assert all(m["actor/grad_norm"] > 0 for m in steps)


def test_lora_with_a_rollout_of_its_own_sends_adapters_and_trains_the_colocated_runs_samples(
    config, tmp_path
):
    """With LoRA the rollout's own workers hold the base from model.path and take only the adapters
    after each update (the native engine applies them unmerged): the run learns what the colocated
    one does. A run resumed from its checkpoint sends the checkpoint's adapters before its first
    generation."""
    config["actor_rollout_ref"]["model"].update(
        {"lora_rank": 8, "lora_alpha": 16, "target_modules": "all-linear"}
    )
    # adapters that move the samples
    config["actor_rollout_ref"]["actor"]["optim"]["lr"] = 1e-2
    native = ["actor_rollout_ref.rollout.name=native", "trainer.save_freq=2"]
    colocated, _ = train(config, tmp_path, "colocated", *native)
    apart, _ = train(config, tmp_path, "apart", *APART, *native)
    for mine, theirs in zip(apart, colocated):
        for key in LEARNING:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
    assert colocated[1]["response_length/mean"] != colocated[0]["response_length/mean"] or (
        colocated[2]["critic/score/mean"] != colocated[0]["critic/score/mean"]
        # the adapters changed what was sampled: the weights sent were used
    )
    resumed, _ = train(config, tmp_path, "apart", *APART, *native, "trainer.total_training_steps=4")
    straight, _ = train(
        config, tmp_path, "straight", *APART, *native, "trainer.total_training_steps=4"
    )
    assert resumed[-1]["step"] == straight[-1]["step"] == 4
    # step 4's samples came from the checkpoint's adapters, sent before it generated
    for key in LEARNING:
        assert resumed[-1][key] == pytest.approx(straight[-1][key], rel=1e-4, abs=1e-6), key


def test_lora_with_a_rollout_of_its_own_on_transformers_generate_is_refused_with_the_fix(config):
    from keel.config.load import load_config
    from keel.errors import INCOMPATIBLE_OPTIONS, KeelError

    config["actor_rollout_ref"]["model"]["lora_rank"] = 8
    with pytest.raises(KeelError) as refused:
        load_config(config, [*APART, "actor_rollout_ref.rollout.name=hf"])
    assert refused.value.code == INCOMPATIBLE_OPTIONS and "rollout.name=native" in refused.value.fix


@pytest.mark.parametrize(
    "layout", [APART, ["trainer.n_gpus_per_node=2"]], ids=["rollout-apart", "two-ranks"]
)
def test_ray_ranks_tell_each_finished_sample_so_its_scoring_begins_beside_generation(
    config, tmp_path, layout
):
    """Samples generated in Ray workers reach the driver as each finishes (a Ray queue), and their
    scoring begins in the reward's processes then: all of each batch had begun before the batch came
    back. With reward.score_ahead=false none had, and the run learns the same."""
    scoring = ["reward.num_workers=2", "actor_rollout_ref.rollout.name=native"]
    ahead, _ = train(config, tmp_path, "ahead", *layout, *scoring)
    assert [m["reward/scored_ahead"] for m in ahead] == [1.0] * 3
    whole, _ = train(config, tmp_path, "whole", *layout, *scoring, "reward.score_ahead=false")
    assert [m["reward/scored_ahead"] for m in whole] == [0.0] * 3
    for mine, theirs in zip(ahead, whole):
        for key in LEARNING:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key


def test_remax_with_a_rollout_of_its_own_in_async_mode_sends_its_greedy_pass_after_the_batch(
    config, tmp_path
):
    """The greedy responses go to the rollout's workers right after their batch (a rank runs its
    calls in order, so the same weights answer both) while the actor trains."""
    steps, _ = train(
        config, tmp_path, "remax", *APART, "trainer.mode=async", "algorithm.adv_estimator=remax"
    )
    assert [m["async/staleness/max"] for m in steps] == [0.0, 1.0, 1.0]
    assert all(m["actor/grad_norm"] > 0 and "critic/advantages/mean" in m for m in steps)
