"""The quick-start trains with LoRA (lora_rank=8, all-linear) on CPU, and its score rises as the
full-parameter run's does."""

import json
import subprocess
import sys
from pathlib import Path

import yaml

from keel.api import train

QUICKSTART = Path(__file__).parents[2] / "examples" / "quickstart"


def last_scores(run_dir: Path) -> float:
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scores = [m["critic/score/mean"] for m in steps if m["step"] > 0]
    return sum(scores[-5:]) / 5, sum(scores[:3]) / 3


def test_the_quickstart_learns_with_lora_as_it_does_in_full(tmp_path):
    subprocess.run(
        [sys.executable, str(QUICKSTART / "prepare.py"), str(tmp_path / "data")],
        check=True,
        timeout=600,
    )
    cfg = yaml.safe_load((QUICKSTART / "grpo.yaml").read_text())
    cfg["data"].update(
        train_files=[str(tmp_path / "data/train.jsonl")],
        val_files=[str(tmp_path / "data/val.jsonl")],
    )
    cfg["actor_rollout_ref"]["model"]["path"] = str(tmp_path / "data/model")
    cfg["custom_reward_function"]["path"] = str(QUICKSTART / "reward.py")
    cfg["trainer"].update(test_freq=-1, save_freq=-1, logger=[])
    full = train(
        {**cfg, "trainer": {**cfg["trainer"], "default_local_dir": str(tmp_path / "full")}}
    )
    lora = train(
        {**cfg, "trainer": {**cfg["trainer"], "default_local_dir": str(tmp_path / "lora")}},
        [
            "actor_rollout_ref.model.lora_rank=8",
            "actor_rollout_ref.model.target_modules=all-linear",
            "actor_rollout_ref.actor.optim.lr=1e-2",
        ],
        # adapters take a larger step, as usual for LoRA
    )
    (full_end, full_start), (lora_end, lora_start) = (
        last_scores(full.run_dir),
        last_scores(lora.run_dir),
    )
    # the full-parameter run learns the task ...
    assert full_end > full_start + 0.3
    # ... and so does LoRA
    assert lora_end > lora_start + 0.3 and lora_end > 0.7 * full_end
