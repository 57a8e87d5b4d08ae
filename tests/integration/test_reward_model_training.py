"""`keel train examples/quickstart/reward_model.yaml` end to end on CPU: a Bradley-Terry reward
model learns the quick-start's preference, its run directory is a sequence classifier that
transformers and keel's own reward model load, and GRPO scores with it as it is."""

import json
import math
from pathlib import Path

import pytest
import torch

from keel.api import train

QUICKSTART = Path(__file__).parents[2] / "examples" / "quickstart"


@pytest.fixture(scope="module")
def data(quickstart_data) -> Path:
    return quickstart_data


def reward_model(data: Path, run_dir: Path, *overrides: str, train_file: Path | None = None):
    """`keel train examples/quickstart/reward_model.yaml` with its files in `data` and its run in
    `run_dir`."""
    return train(
        str(QUICKSTART / "reward_model.yaml"),
        [
            f"data.train_files=[{train_file or data / 'preference.jsonl'}]",
            f"data.val_files=[{data / 'preference_val.jsonl'}]",
            f"model.path={data / 'model'}",
            f"trainer.default_local_dir={run_dir}",
            "trainer.logger=[]",
            *overrides,
        ],
    )


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> Path:
    """The quick-start's reward model, trained for its 32 steps: its run directory."""
    return reward_model(data, tmp_path_factory.mktemp("rm") / "run").run_dir


def test_the_quickstart_reward_model_learns_the_preference(trained):
    metrics = read_metrics(trained)
    assert [m["step"] for m in metrics] == list(range(1, 33))
    for name in ("train/loss", "rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert all(name in m for m in metrics), name
    assert "rewards/accuracies" in metrics[-1] and "perf/throughput" in metrics[-1]
    last = metrics[-1]
    assert last["val/rewards/accuracies"] > 0.8 and last["rewards/accuracies"] > 0.8
    assert last["train/loss"] < metrics[0]["train/loss"] and last["train/loss"] < math.log(2)


@pytest.fixture(scope="module")
def trained_with_lora(data, tmp_path_factory) -> Path:
    """The same with LoRA adapters (rank 8) and the score head trained in full beside them."""
    run_dir = tmp_path_factory.mktemp("rm_lora") / "run"
    return reward_model(data, run_dir, "model.lora_rank=8", "optim.lr=1e-2").run_dir


@pytest.mark.parametrize("which", ["trained", "trained_with_lora"])
def test_the_run_directory_is_a_reward_model_transformers_and_keel_load(which, request):
    from transformers import AutoModelForSequenceClassification

    from keel.rewards.model import RewardModel

    trained = request.getfixturevalue(which)
    classifier = AutoModelForSequenceClassification.from_pretrained(trained)
    assert classifier.config.num_labels == 1
    assert not (trained / "reference_logps.pt").exists()
    # LoRA's run directory holds the adapters merged; the adapters themselves beside them
    assert (trained / "adapter").is_dir() == (which == "trained_with_lora")

    rm = RewardModel(str(trained), torch.device("cpu"), 4, None)
    # prompts the quick-start's data never holds (its numbers stop at 99)
    held_out = [(123, 456), (7, 1000), (555, 0)]
    prompts, responses = [], []
    for a, b in held_out:
        chat = [{"role": "user", "content": f"Reply with digits only: {a} {b}"}]
        prompts += [chat, chat]
        responses += [f"{a}{b}", f"The numbers are {a} and {b}."]
    scores = rm.score(prompts, responses)
    assert all(isinstance(s, float) and math.isfinite(s) for s in scores), scores
    for digits, words in zip(scores[0::2], scores[1::2]):
        assert digits > words, scores


def test_grpo_scores_with_the_trained_reward_model(data, trained, tmp_path):
    """The quick-start's GRPO for one step, its rewards from the reward model instead of
    reward.py (which scores the share of digits, in [0, 1])."""
    result = train(
        str(QUICKSTART / "grpo.yaml"),
        {
            "data.train_files": [str(data / "train.jsonl")],
            "data.val_files": [str(data / "val.jsonl")],
            "actor_rollout_ref.model.path": str(data / "model"),
            "trainer.default_local_dir": str(tmp_path / "grpo"),
            "trainer.total_training_steps": 1,
            "trainer.test_freq": -1,
            "trainer.save_freq": -1,
            "trainer.logger": [],
            "reward_model.enable": True,
            "reward_model.model.path": str(trained),
            "custom_reward_function.path": None,
        },
    )
    metrics = result.last_metrics
    assert result.last_step == 1 and metrics["reward/not_scored_ratio"] == 0.0
    assert math.isfinite(metrics["critic/score/mean"]) and metrics["critic/score/mean"] != 0.0
    # a reward model's score, not a share of digits: the random policy's text scores below 0
    assert metrics["critic/score/min"] < 0.0
    assert metrics["critic/score/max"] > metrics["critic/score/min"]
    samples = [
        json.loads(line) for line in (result.run_dir / "samples.jsonl").read_text().splitlines()
    ]
    scores = [s["score"] for s in samples if s.get("step") == 1]
    assert len(scores) > 1 and len(set(scores)) > 1


def one_pair_step(data: Path, run_dir: Path, *overrides: str, train_file: Path | None = None):
    """Step 1 of the reward model on a single pair: its metrics are that pair's scores."""
    result = reward_model(
        data,
        run_dir,
        "data.train_batch_size=1",
        "data.micro_batch_size_per_gpu=1",
        "trainer.total_training_steps=1",
        *overrides,
        train_file=train_file,
    )
    return read_metrics(result.run_dir)[0]


def test_a_margin_column_and_centering_enter_the_loss(data, tmp_path):
    rows = [json.loads(line) for line in (data / "preference.jsonl").read_text().splitlines()]
    with_margins = tmp_path / "margins.jsonl"
    with_margins.write_text("".join(json.dumps({**row, "margin": 2.0}) + "\n" for row in rows))

    plain = one_pair_step(data, tmp_path / "plain", "reward_model.center_coefficient=0")
    margin = one_pair_step(
        data, tmp_path / "margin", "reward_model.center_coefficient=0", train_file=with_margins
    )
    centered = one_pair_step(data, tmp_path / "centered", "reward_model.center_coefficient=0.5")
    # the same pair and the same starting scores in each run
    for run in (margin, centered):
        assert run["rewards/chosen"] == pytest.approx(plain["rewards/chosen"], abs=1e-6)
        assert run["rewards/rejected"] == pytest.approx(plain["rewards/rejected"], abs=1e-6)
    chosen, rejected = plain["rewards/chosen"], plain["rewards/rejected"]

    def bradley_terry(difference: float) -> float:
        return -math.log(1 / (1 + math.exp(-difference)))

    assert plain["train/loss"] == pytest.approx(bradley_terry(chosen - rejected), rel=1e-5)
    # chosen must win by the margin: the same scores lose more
    assert margin["train/loss"] == pytest.approx(bradley_terry(chosen - rejected - 2.0), rel=1e-5)
    assert margin["train/loss"] > plain["train/loss"]
    assert centered["train/loss"] == pytest.approx(
        plain["train/loss"] + 0.5 * (chosen + rejected) ** 2, rel=1e-5
    )
    assert centered["train/loss"] > plain["train/loss"]
