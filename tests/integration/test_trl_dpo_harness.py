"""benchmarks/trl_dpo.py, the TRL side of benchmark d1, run on a tiny model on the CPU: one step
warmed up, one timed, one JSON record appended."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from keel.models.tiny import make_tiny_model

pytest.importorskip("trl", minversion="1.16")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "trl_dpo.py"
FIELDS = {
    "workload",
    "side",
    "trl_version",
    "device",
    "trl_step_time_s",
    "trl_step_times_s",
    "trl_peak_memory_gb",
    "pairs",
    "prompt",
    "completion",
    "micro",
}


def test_trl_dpo_harness_appends_one_timed_record(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    out = tmp_path / "d1.jsonl"
    sizes = dict(pairs=4, prompt=8, completion=8, micro=2)
    command = [sys.executable, str(SCRIPT), "--model", str(model), "--out", str(out)]
    for name, value in {**sizes, "steps": 1, "warmup": 1}.items():
        command += [f"--{name}", str(value)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = out.read_text().splitlines()
    record = json.loads(line)
    assert set(record) == FIELDS
    assert record["workload"] == "d1" and record["side"] == "trl"
    assert record["trl_version"].startswith("1.16")
    assert record["device"] == "cpu" and record["trl_peak_memory_gb"] is None
    assert {name: record[name] for name in sizes} == sizes
    # the warm-up step is left out of the measured ones
    assert len(record["trl_step_times_s"]) == 1
    assert record["trl_step_time_s"] == record["trl_step_times_s"][0] > 0
