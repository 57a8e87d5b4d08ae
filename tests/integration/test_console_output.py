"""What `keel train` prints on the quickstart: a page before step 1, each warning once."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> Path:
    """A directory holding the quickstart's files and the data and model its prepare.py writes."""
    root = tmp_path_factory.mktemp("quickstart")
    shutil.copytree(EXAMPLES / "quickstart", root / "examples" / "quickstart")
    subprocess.run(
        [sys.executable, "examples/quickstart/prepare.py"],
        cwd=root,
        check=True,
        capture_output=True,
    )
    return root


def test_quickstart_prints_a_page_before_step_1_and_each_warning_once(quickstart):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "keel",
            "train",
            "examples/quickstart/grpo.yaml",
            "trainer.total_training_steps=6",
        ],
        cwd=quickstart,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    lines = (run.stderr + run.stdout).splitlines()
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1 |"))
    assert first_step <= 40, "\n".join(lines[:first_step])
    before = "\n".join(lines[:first_step])
    for part in (
        "keel check: 9 passed",
        "batch plan: 8 prompts x 8 samples = 64",
        "run directory: ",
    ):
        assert part in before
    # the resolved config is in the run directory, not the console
    assert "data:\n  train_files" not in before

    # The quickstart's responses hit max_response_length every step: the warning is printed once,
    # then counted, and the count is told at the end and kept as a metric.
    warnings = [line for line in lines if re.match(r"keel: step \d+: ", line)]
    texts = [re.sub(r"\d+", "#", line.split(": ", 2)[2]) for line in warnings]
    assert texts and len(texts) == len(set(texts)), warnings
    run_dir = quickstart / "checkpoints" / "quickstart" / "grpo_digits"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    counts = [r["guards/warned_steps/responses_cut_off"] for r in records if r["step"] > 0]
    clipped = [r["response_length/clip_ratio"] > 0.9 for r in records if r["step"] > 0]
    assert counts[0] == 1 and counts[-1] == sum(clipped) > 1 and counts == sorted(counts)
    assert f"keel: this warning came {counts[-1]:.0f} times, printed once: step 1: " in run.stderr

    # What the console leaves out is in the run directory.
    check = (run_dir / "check.txt").read_text()
    assert "decided for you" in check and "batch plan" in check and "[ok  ] reward" in check
    assert "train_files" in (run_dir / "config.yaml").read_text()
    assert json.loads((run_dir / "batch_plan.json").read_text())["samples_per_step"] == 64


def test_a_finished_run_asked_again_returns_its_last_metrics(quickstart, tmp_path):
    import keel

    overrides = [
        "trainer.total_training_steps=2",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "data.train_files=[" + str(quickstart / "examples/data/train.jsonl") + "]",
        "data.val_files=[" + str(quickstart / "examples/data/val.jsonl") + "]",
        f"actor_rollout_ref.model.path={quickstart / 'examples/data/model'}",
        f"custom_reward_function.path={quickstart / 'examples/quickstart/reward.py'}",
    ]
    config = str(quickstart / "examples/quickstart/grpo.yaml")
    first = keel.train(config, overrides)
    # "nothing to do": the run is at its last step
    again = keel.train(config, overrides)

    assert again.last_step == first.last_step == 2
    assert again.last_metrics["critic/score/mean"] == first.last_metrics["critic/score/mean"]
    assert again.last_metrics["val/digits/acc"] == first.last_metrics["val/digits/acc"]
