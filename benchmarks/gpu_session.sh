#!/usr/bin/env bash
# One device call that measures what the speed issue tracks, writing everything under $OUT:
#   bash benchmarks/gpu_session.sh [WORKLOADS] [GPUS]      (defaults: t1,w1,w2,w3 and 1)
# Run from the repository root on the GPU machine, after installing carried wheels into .site
# (../shared/device/wheels.sh ray==2.60.0 jsonschema jsonschema-specifications referencing rpds-py).
set -u
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/.site:$PWD
workloads=${1:-t1,w1,w2,w3}
gpus=${2:-1}
timeout 120 python3 -m pytest -q tests/gpu > "$OUT/gpu_tests.txt" 2>&1; tail -1 "$OUT/gpu_tests.txt"
timeout 120 python3 benchmarks/profile_update.py > "$OUT/profile_update.txt" 2>&1; tail -8 "$OUT/profile_update.txt"
timeout 120 python3 benchmarks/profile_decode.py --batch 256 --prompt 256 --steps 512 > "$OUT/profile_decode.txt" 2>&1
tail -8 "$OUT/profile_decode.txt"
python3 -m keel bench "$workloads" --gpus "$gpus" --out "$OUT/bench.jsonl" > "$OUT/bench.log" 2>&1
python3 - "$OUT/bench.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["workload"], r["n_gpus"], r["engine"], f"step {r['step_time_s']:.2f}s",
          f"gen {r['gen_tokens_per_s']:.0f} tok/s", f"update {r['update_tokens_per_s']:.0f} tok/s",
          f"mfu {r['update_mfu']:.3f}", f"peak {r['peak_memory_gb']:.1f} GB", f"gap {r['log_prob_gap']:.2g}")
PY
