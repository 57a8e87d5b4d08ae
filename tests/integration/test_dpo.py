"""`keel train examples/quickstart/dpo.yaml` end to end on CPU: TRL's metrics, the policy learns the
quick-start's preference, every loss learns, the reference is the starting model however it is
obtained, resume is exact and the run directory is a Hugging Face model."""

import json
import math
from pathlib import Path

import pytest
import torch

from keel.api import train

QUICKSTART = Path(__file__).parents[2] / "examples" / "quickstart"
TRL_METRICS = (
    "train/loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
    "perf/throughput",
)


@pytest.fixture(scope="module")
def data(quickstart_data) -> Path:
    return quickstart_data


def dpo(data: Path, run_dir: Path, *overrides: str):
    """`keel train examples/quickstart/dpo.yaml` with its files in `data` and its run in
    `run_dir`."""
    return train(
        str(QUICKSTART / "dpo.yaml"),
        [
            f"data.train_files=[{data / 'preference.jsonl'}]",
            f"data.val_files=[{data / 'preference_val.jsonl'}]",
            f"model.path={data / 'model'}",
            f"trainer.default_local_dir={run_dir}",
            "trainer.logger=[]",
            *overrides,
        ],
    )


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_timings(metrics: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/"))} for m in metrics
    ]


def assert_same_metrics(a: list[dict], b: list[dict], atol: float) -> None:
    a, b = without_timings(a), without_timings(b)
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for step_a, step_b in zip(a, b):
        assert step_a.keys() == step_b.keys()
        for name in step_a:
            # before the first update chosen and rejected rewards tie at 0, and float noise ranks
            # the tie
            if name.endswith("rewards/accuracies") and step_a["step"] == 1:
                continue
            assert step_a[name] == pytest.approx(step_b[name], abs=atol), (step_a["step"], name)


def test_the_quickstart_learns_its_preference_and_the_run_directory_is_the_model(data, tmp_path):
    from transformers import AutoModelForCausalLM

    from keel.data.preference import PairColumns, build_pairs
    from keel.data.prompts import load_rows
    from keel.models.load import load_tokenizer
    from keel.training.preference import collate_pairs, pair_log_probs

    result = dpo(data, tmp_path / "run")
    metrics = read_metrics(result.run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 33))
    for name in TRL_METRICS:
        assert all(name in m for m in metrics), name
    assert "val/rewards/accuracies" in metrics[-1]
    # the reference is the starting model: no preference yet, the loss is ln 2
    assert metrics[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-4)
    last = metrics[-1]
    assert last["rewards/accuracies"] > 0.8 and last["val/rewards/accuracies"] > 0.8
    assert last["train/loss"] < math.log(2) - 0.1
    assert last["rewards/margins"] == pytest.approx(
        last["rewards/chosen"] - last["rewards/rejected"], abs=1e-4
    )

    # The run directory loads as a plain causal LM, and it is the model the validation measured:
    # its log-probs of the validation pairs, against the starting model's, give val's margins.
    trained = AutoModelForCausalLM.from_pretrained(result.run_dir).eval()
    start = AutoModelForCausalLM.from_pretrained(data / "model").eval()
    tokenizer = load_tokenizer(str(result.run_dir))
    pairs, _ = build_pairs(
        load_rows([str(data / "preference_val.jsonl")], "data.val_files"),
        tokenizer,
        PairColumns("prompt", "chosen", "rejected", "margin"),
        max_length=96,
        truncation="left",
        for_reward_model=False,
        name="val",
    )
    batch = collate_pairs(pairs, tokenizer.pad_token_id, True, 192)
    with torch.no_grad():
        policy, reference = pair_log_probs(trained, batch)[0], pair_log_probs(start, batch)[0]
    margins = 0.1 * (
        (policy.chosen - reference.chosen) - (policy.rejected - reference.rejected)
    )  # beta 0.1
    assert margins.mean().item() == pytest.approx(last["val/rewards/margins"], rel=1e-3)


@pytest.mark.parametrize(
    "overrides",
    [
        ["dpo.loss_type=sigmoid"],
        ["dpo.loss_type=ipo"],
        ["dpo.loss_type=hinge"],
        ["dpo.loss_type=robust", "dpo.label_smoothing=0.1"],
        ["dpo.loss_type=simpo"],
        ["dpo.loss_type=sigmoid", "dpo.sft_weight=1.0"],
    ],
    ids=["sigmoid", "ipo", "hinge", "robust", "simpo", "sigmoid+sft"],
)
def test_every_loss_learns(data, tmp_path, overrides):
    result = dpo(data, tmp_path / "run", "trainer.total_training_steps=4", *overrides)
    metrics = read_metrics(result.run_dir)
    assert len(metrics) == 4
    assert metrics[-1]["train/loss"] < metrics[0]["train/loss"]
    assert metrics[-1]["rewards/margins"] > metrics[0]["rewards/margins"]
    if "dpo.sft_weight=1.0" in overrides:
        # the loss is DPO's plus the NLL of the chosen completions
        for m in metrics:
            assert m["train/loss"] == pytest.approx(m["train/dpo_loss"] + m["train/sft_loss"])
        assert metrics[-1]["train/sft_loss"] < metrics[0]["train/sft_loss"]


def test_a_cached_reference_trains_as_a_frozen_copy_of_the_model_does(data, tmp_path):
    steps = "trainer.total_training_steps=3"
    cached = dpo(data, tmp_path / "cached", steps, "dpo.reference=cached")
    frozen = dpo(data, tmp_path / "model", steps, "dpo.reference=model")
    assert (cached.run_dir / "reference_logps.pt").is_file()
    assert not (frozen.run_dir / "reference_logps.pt").exists()
    a, b = read_metrics(cached.run_dir), read_metrics(frozen.run_dir)
    assert_same_metrics(a, b, atol=1e-5)
    # the reference stays where training started while the policy moves away from it
    assert a[-1]["train/loss"] < math.log(2) - 0.01


def test_with_lora_the_adapters_off_reference_is_the_cached_one(data, tmp_path):
    lora = ["trainer.total_training_steps=3", "model.lora_rank=8", "optim.lr=1e-2"]
    cached = dpo(data, tmp_path / "cached", *lora, "dpo.reference=cached")
    adapter = dpo(data, tmp_path / "adapter", *lora, "dpo.reference=adapter")
    a, b = read_metrics(cached.run_dir), read_metrics(adapter.run_dir)
    assert_same_metrics(a, b, atol=1e-5)
    assert a[-1]["train/loss"] < math.log(2) - 0.01


# validation and a checkpoint every 2 steps
RESUMABLE = ("trainer.save_freq=2", "trainer.test_freq=2", "trainer.resume_mode=auto")


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory) -> list[dict]:
    """The metrics of a 4-step run that nothing stopped."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    dpo(data, run_dir, *RESUMABLE, "trainer.total_training_steps=4")
    return read_metrics(run_dir)


def test_a_run_stopped_mid_way_resumes_exactly(data, tmp_path, straight, monkeypatch):
    from keel.trainer.preference import PreferenceTrainer

    real_step = PreferenceTrainer.train_step

    def stop_at_step_3(self):
        if self.step == 3:
            raise KeyboardInterrupt
        return real_step(self)

    run = (data, tmp_path / "run", *RESUMABLE, "trainer.total_training_steps=4")
    monkeypatch.setattr(PreferenceTrainer, "train_step", stop_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        dpo(*run)
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2]
    monkeypatch.setattr(PreferenceTrainer, "train_step", real_step)
    result = dpo(*run)
    assert result.last_step == 4
    assert_same_metrics(read_metrics(result.run_dir), straight, atol=1e-6)


def test_a_resumed_run_reads_its_reference_log_probs_again(data, tmp_path, straight, caplog):
    run_dir = tmp_path / "run"
    dpo(data, run_dir, *RESUMABLE, "trainer.total_training_steps=2")
    cache = run_dir / "reference_logps.pt"
    assert cache.is_file()
    written = cache.stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level("INFO", logger="keel"):
        dpo(data, run_dir, *RESUMABLE, "trainer.total_training_steps=4")
    assert "reference log-probs read from" in caplog.text
    assert "kept in" not in caplog.text
    assert cache.stat().st_mtime_ns == written
    # going on for more steps is the run that was asked for 4 from the start
    assert_same_metrics(read_metrics(run_dir), straight, atol=1e-6)


def test_a_resumed_run_without_its_cache_recomputes_it_from_the_starting_model(
    data, tmp_path, straight, caplog
):
    run_dir = tmp_path / "run"
    dpo(data, run_dir, *RESUMABLE, "trainer.total_training_steps=2")
    cache = run_dir / "reference_logps.pt"
    original = torch.load(cache, weights_only=True)["log_probs"]
    cache.unlink()
    caplog.clear()
    with caplog.at_level("INFO", logger="keel"):
        dpo(data, run_dir, *RESUMABLE, "trainer.total_training_steps=4")
    assert "kept in" in caplog.text
    again = torch.load(cache, weights_only=True)["log_probs"]
    assert again.keys() == original.keys() == {"train", "val"}
    for split in original:
        torch.testing.assert_close(again[split], original[split], atol=1e-5, rtol=0)
    metrics = read_metrics(run_dir)
    # the model resumed from has moved away from the starting model
    assert metrics[1]["logps/chosen"] != pytest.approx(metrics[0]["logps/chosen"], abs=1e-3)
    assert_same_metrics(metrics, straight, atol=1e-6)


@pytest.mark.parametrize(
    "layout",
    [
        ["data.share_prompt=false", "data.padding_free=true"],
        ["data.share_prompt=true", "data.padding_free=true"],
        ["data.share_prompt=true", "data.padding_free=false"],
    ],
)
def test_every_layout_gives_the_padded_step(data, tmp_path, layout):
    steps = "trainer.total_training_steps=2"
    packed = read_metrics(dpo(data, tmp_path / "packed", steps, *layout).run_dir)
    padded = read_metrics(
        dpo(
            data, tmp_path / "padded", steps, "data.padding_free=false", "data.share_prompt=false"
        ).run_dir
    )
    for name in ("train/loss", "logps/chosen", "logps/rejected", "train/grad_norm"):
        assert packed[0][name] == pytest.approx(padded[0][name], abs=1e-5, rel=1e-5), name
    # after one update on the same gradient, the same step again
    assert packed[1]["train/loss"] == pytest.approx(padded[1]["train/loss"], abs=1e-5)
    assert packed[1]["rewards/margins"] == pytest.approx(padded[1]["rewards/margins"], abs=1e-4)
