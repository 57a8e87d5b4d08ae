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
