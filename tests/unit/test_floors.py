"""benchmarks/floors.py: the roofline floor of a workload's step, phase by phase."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from floors import floors  # noqa: E402


def test_compute_bound_phases_scale_with_the_mfu_and_decode_with_the_bandwidth():
    full = floors("t1", "H100", 1.0, 1.0, 4)
    half = floors("t1", "H100", 0.5, 1.0, 4)
    for phase in ("prefill", "old_log_probs"):
        assert half[phase] == pytest.approx(2 * full[phase], rel=1e-3)
    # 128 rows of a 0.5B model: a decode step is bound by its bytes, so the H200's faster HBM
    # (4.8 against 3.35 TB/s, the same dense peak) shortens it in proportion
    h200 = floors("t1", "H200", 1.0, 1.0, 4)
    assert h200["decode"] == pytest.approx(full["decode"] * 3.35 / 4.8, rel=1e-3)
    assert full["step"] == pytest.approx(
        sum(full[p] for p in ("decode", "prefill", "old_log_probs", "update")), abs=1e-3
    )


def test_qwen3s_larger_cache_makes_its_decode_floor_higher_than_qwen25s():
    # Qwen3-0.6B keeps 8 KV heads of 128 a layer against Qwen2.5-0.5B's 2 of 64
    assert (
        floors("q1", "H100", 1.0, 1.0, 4)["decode"]
        > 2 * floors("t1", "H100", 1.0, 1.0, 4)["decode"]
    )
