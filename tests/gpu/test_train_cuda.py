"""keel train on one GPU: bf16 weights, the same loop; run by hand on the GPU machine."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("estimator, dtype", [("grpo", "bfloat16"), ("gae", "float32")])
def test_train_on_gpu(estimator, dtype, tiny_config, tiny_assets):
    from keel.api import train

    tiny_config["algorithm"]["adv_estimator"] = estimator
    tiny_config["actor_rollout_ref"]["model"]["dtype"] = dtype
    # verl's default: bf16 weights would not move
    tiny_config["actor_rollout_ref"]["actor"]["optim"]["lr"] = 1e-6
    tiny_config["trainer"]["device"] = "cuda"
    result = train(tiny_config)

    assert result.last_step == 2
    records = [
        json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert all(math.isfinite(v) for r in records for v in r.values())
    before = load_file(tiny_assets["model"] / "model.safetensors")
    after = load_file(Path(result.run_dir) / "global_step_2" / "actor" / "model.safetensors")
    # float32 master weights
    assert all(t.dtype == torch.float32 for t in after.values())
    changed = sum(int((before[k] != after[k]).sum()) for k in before)
    assert changed > 0.5 * sum(t.numel() for t in before.values())
    # sampler and trainer log-probs agree (bf16 rounding allowed)
    assert records[-1]["rollout/log_prob_gap"] < (0.05 if dtype == "bfloat16" else 1e-3)


def test_phi3_trains_on_the_native_engine(tiny_config, tmp_path):
    """Phi-3 (fused qkv and gate_up weights, a sliding window shorter than the prompts) samples
    on keel's native engine and trains, the sampler's log-probs agreeing with the trainer's."""
    from keel.api import train
    from keel.models.tiny import make_tiny_model

    phi3 = make_tiny_model(tmp_path / "phi3", arch="phi3", hidden_size=64, num_layers=2)
    tiny_config["actor_rollout_ref"]["model"]["path"] = str(phi3)
    tiny_config["actor_rollout_ref"]["rollout"]["name"] = "native"
    tiny_config["trainer"]["device"] = "cuda"
    result = train(tiny_config)

    records = [
        json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert result.last_step == 2
    assert all(math.isfinite(v) for r in records for v in r.values())
    assert records[-1]["rollout/log_prob_gap"] < 0.05


def test_an_async_run_ends_and_its_process_exits_with_a_batch_still_scoring(tmp_path):
    """Issue 50: `keel bench s1 trainer.mode=async` did not finish on a fresh H100; the process
    waited out the batch deadline of the batch generated ahead, whose scoring workers the run's end
    had terminated. tinys is s1's slow scorer (1 s a sample) on the tiny model, on the GPU; with
    an hour's reward.timeout_s that wait would outlast the limit here."""
    import subprocess
    import sys

    out = tmp_path / "s.jsonl"
    args = ["bench", "tinys", "trainer.mode=async", "reward.timeout_s=3600", "--gpus", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "keel", *args, "--steps", "2", "--warmup", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["device"].startswith("NVIDIA") and record["async"]["staleness/max"] > 0
    # issue 50: weights synced in place, the tiny cache and its graphs kept between steps
    assert record["weight_sync"]["path"] == "in place on the device"
    assert record["kv_cache"]["kept"] is True
    assert "not scored" not in done.stderr + done.stdout and "leaked" not in done.stderr
