"""The CPU demo's GRPO step, alone and beside busy processes (issue 32: a laptop is a shared
machine).

Each run is a fresh process training the demo's GRPO stage (its data, model shape and batch) for a
few steps from the random initial model; SFT is left out, since it changes what is learnt, not
what a step costs. A competing load is K processes spinning on the same cores. The record is the
median step time over the steps after the first (which warms caches), and the ratio of each loaded
run to the same variant alone, measured in the same invocation:

    python benchmarks/cpu_contention.py --steps 10 --loads 0,2 --variants keel,spin \
        --out benchmarks/results/cpu_contention.jsonl

Variants: `keel` (keel's default: torch's OpenMP threads sleep while they wait, keel/openmp.py),
`spin` (libgomp's own default, GOMP_SPINCOUNT=300000: a waiting thread spins first, as before
keel set it), `one-thread` (OMP_NUM_THREADS=1). `--cores 0,1` pins everything to those cores
(taskset), to stand for a 2-core machine on a bigger one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys
from pathlib import Path
from keel.api import train
from keel.demo import DemoSettings, grpo_config
out, steps = Path(sys.argv[1]), int(sys.argv[2])
data = {name: out / "data" / f"{name}.jsonl" for name in ("rl", "heldout")}
cfg = grpo_config(out, data, DemoSettings())
cfg["actor_rollout_ref"]["model"]["path"] = str(out / "init_model")
cfg["trainer"].update(total_training_steps=steps, test_freq=0, val_before_train=False, save_freq=0,
                      logger=[], default_local_dir=sys.argv[3])
train(cfg)
"""


def prepare(out: Path) -> None:
    from keel.demo import DemoSettings, make_data
    from keel.models.tiny import make_tiny_model

    s = DemoSettings()
    make_data(out, s)
    make_tiny_model(
        out / "init_model",
        hidden_size=s.hidden_size,
        num_layers=s.num_layers,
        num_heads=4,
        num_kv_heads=2,
        seed=s.seed,
    )


VARIANTS = {
    "keel": {},
    "spin": {"GOMP_SPINCOUNT": "300000"},
    "one-thread": {"OMP_NUM_THREADS": "1"},
}


def busy(n: int, cores: str | None) -> list[subprocess.Popen]:
    cmd = [sys.executable, "-c", "while True: pass"]
    return [subprocess.Popen(["taskset", "-c", cores, *cmd] if cores else cmd) for _ in range(n)]


def one_run(
    out: Path, steps: int, variant: str, load: int, cores: str | None, timeout_s: float
) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="run_", dir=out))
    env = {
        **{
            k: v
            for k, v in os.environ.items()
            if k not in VARIANTS["spin"] and k != "OMP_WAIT_POLICY"
        },
        **VARIANTS[variant],
        "CUDA_VISIBLE_DEVICES": "",
    }
    competitors = busy(load, cores)
    start = time.perf_counter()
    try:
        cmd = [sys.executable, "-c", CHILD, str(out), str(steps), str(run_dir)]
        subprocess.run(
            ["taskset", "-c", cores, *cmd] if cores else cmd,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=timeout_s,
        )
    # what finished is still a record: the steps in metrics.jsonl
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in competitors:
            p.kill()
            p.wait()
    metrics = run_dir / "metrics.jsonl"
    records = (
        [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    )
    times = [r["timing_s/step"] for r in records if r["step"] >= 2]
    return {
        "variant": variant,
        "load": load,
        "steps": len(times),
        "step_s_median": statistics.median(times) if times else None,
        "timed_out": len(times) < steps - 1,
        "step_s": times,
        "wall_s": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--loads", default="0,2")
    parser.add_argument("--variants", default="keel,spin")
    parser.add_argument(
        "--cores", default=None, help="pin the run and its load to these cores (taskset -c)"
    )
    parser.add_argument(
        "--timeout", type=float, default=300, help="seconds a run may take (its steps so far count)"
    )
    parser.add_argument("--out", default=None, help="append the records to this JSONL file")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="keel_contention_"))
    prepare(work)
    # variant -> its step alone, the last measured
    alone: dict[str, float] = {}
    for variant in args.variants.split(","):
        for load in (int(x) for x in args.loads.split(",")):
            record = one_run(work, args.steps, variant, load, args.cores, args.timeout)
            if load == 0:
                alone[variant] = record["step_s_median"]
            if alone.get(variant) and record["step_s_median"]:
                record["over_alone"] = record["step_s_median"] / alone[variant]
            record.update(
                commit=os.environ.get("KEEL_COMMIT"),
                machine=platform.processor() or platform.machine(),
                cpus=len(os.sched_getaffinity(0)) if not args.cores else len(args.cores.split(",")),
            )
            print(json.dumps({k: v for k, v in record.items() if k != "step_s"}), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
