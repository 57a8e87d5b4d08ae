#!/usr/bin/env bash
# One device call that measures what the speed issues track, writing everything under $OUT:
#   bash benchmarks/gpu_session.sh [WORKLOADS] [GPUS]      (defaults: t1,w1,w2,w3 and 1,2)
# Run from the repository root on the GPU machine (nvidia-h200-x2 for GPUS=1,2), after installing
# carried wheels into .site (../shared/device/wheels.sh ray==2.60.0 jsonschema
# jsonschema-specifications referencing rpds-py). Each part has its own time limit, most important
# first, so a call cut short still brings back what finished.
set -u
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/.site:$PWD
workloads=${1:-t1,w1,w2,w3}
gpus=${2:-1,2}
timeout 150 python3 -m pytest -q tests/gpu > "$OUT/gpu_tests.txt" 2>&1; tail -1 "$OUT/gpu_tests.txt"
# t1 on every worker count, rank 0 profiled: where a second GPU's time goes
timeout 300 python3 -m keel bench t1 --gpus "$gpus" --steps 3 --warmup 2 --profile "$OUT/profile" \
    --out "$OUT/bench.jsonl" > "$OUT/bench_t1.log" 2>&1
# the same on two GPUs without sharding the actor (DDP): a 0.5B model fits one GPU
timeout 200 python3 -m keel bench t1 actor_rollout_ref.actor.fsdp_config.fsdp_size=1 --gpus 2 --steps 3 --warmup 2 \
    --out "$OUT/bench_ddp.jsonl" > "$OUT/bench_t1_ddp.log" 2>&1
for shape in 0.5b 1.5b; do  # the rollout targets: batch 256, prompt 256, response 512
    timeout 150 python3 benchmarks/profile_decode.py --model "$shape" --batch 256 --prompt 256 --steps 512 \
        > "$OUT/profile_decode_$shape.txt" 2>&1
    grep -E "^(compiled_graphs|attention) " "$OUT/profile_decode_$shape.txt"
done
others=$(echo "$workloads" | tr ',' '\n' | grep -v '^t1$' | paste -sd, -)
[ -n "$others" ] && timeout 600 python3 -m keel bench "$others" --gpus 1 --steps 2 --warmup 1 \
    --out "$OUT/bench.jsonl" > "$OUT/bench_others.log" 2>&1
python3 - "$OUT"/bench*.jsonl <<'PY'
import json, sys
for line in (line for path in sys.argv[1:] for line in open(path)):
    r = json.loads(line)
    t = r["timing_s"]
    print(r["workload"], r["n_gpus"], f"step {r['step_time_s']:.2f}s", f"gen {t['gen']:.2f}s",
          f"update {t['update_actor']:.2f}s", f"sync {t.get('sync_rollout_weights', 0):.3f}s",
          f"gen {r['gen_tokens_per_s']:.0f} tok/s", f"mfu {r['update_mfu']:.3f}", f"peak {r['peak_memory_gb']:.1f} GB",
          f"gap {r['log_prob_gap']:.2g}")
PY
