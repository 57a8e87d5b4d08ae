"""What rollout correction does to a run that learns: the demo's GRPO stage (2-digit addition,
the demo's SFT model as the start) in each mode of `algorithm.rollout_correction`, one run each,
the same seed, computing in a chosen dtype so the sampler and the trainer disagree as they do in
bf16 (the sampler's kernels against the trainer's).

    python benchmarks/rollout_correction.py [--out DIR] [--dtype bfloat16] [--steps 120] [--modes
    A,B] [--seed N]

The first call runs the whole demo in DIR (its SFT stage is the start of every run here). Prints
and appends to benchmarks/results/rollout_correction.jsonl one JSON line per mode: held-out
accuracy before and after GRPO, the mean sampler/trainer gap and mismatch metrics, the old-log-prob
pass's time and the step time.
"""

import argparse
import json
import time
from pathlib import Path
from statistics import mean

from keel.api import train
from keel.bench.record import source_commit
from keel.demo import ADDITION, DemoSettings, run_demo

MODES = {
    "recompute": {},
    "bypass": {"bypass_mode": True},
    "token_tis": {"rollout_is": "token", "rollout_is_threshold": 2.0},
    "seq_mis": {
        "rollout_is": "sequence",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "seq_sum_k1",
        "rollout_rs_threshold": "0.5_2.0",
    },
    "bypass_k3_rs": {
        "bypass_mode": True,
        "rollout_rs": "seq_mean_k3",
        "rollout_rs_threshold": 0.01,
    },
}
ACCURACY = ADDITION.accuracy_key


def run_mode(out: Path, name: str, correction: dict, dtype: str, steps: int, seed: int) -> dict:
    settings = DemoSettings()
    cfg = ADDITION.grpo_config(out, ADDITION.make_data(out, settings), settings)
    cfg["algorithm"]["rollout_correction"] = correction
    cfg["actor_rollout_ref"]["model"]["dtype"] = dtype
    cfg["trainer"].update(
        {
            "default_local_dir": str(out / f"grpo_{name}_{dtype}_seed{seed}"),
            "total_training_steps": steps,
            "logger": [],
            "seed": seed,
        }
    )
    start = time.perf_counter()
    result = train(cfg)
    metrics = [
        json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    steps_logged = [m for m in metrics if m["step"] > 0 and "timing_s/step" in m]

    def average(key: str) -> float | None:
        values = [m[key] for m in steps_logged if key in m]
        return mean(values) if values else None

    accuracy = [m for m in metrics if ACCURACY in m]
    return {
        "mode": name,
        "commit": source_commit(),
        "dtype": dtype,
        "seed": seed,
        "rollout_correction": correction,
        "steps": steps,
        "heldout_acc_start": accuracy[0][ACCURACY],
        "heldout_acc_end": accuracy[-1][ACCURACY],
        "log_prob_gap": average("rollout/log_prob_gap"),
        "rollout_corr_kl": average("rollout_corr/kl"),
        "rollout_corr_chi2_token": average("rollout_corr/chi2_token"),
        "rollout_is_ratio_fraction_high": average("rollout_corr/rollout_is_ratio_fraction_high"),
        "rollout_rs_masked_fraction": average("rollout_corr/rollout_rs_masked_fraction"),
        "old_log_prob_s": average("timing_s/old_log_prob") or 0.0,
        "step_s": average("timing_s/step"),
        "wall_s": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/keel_rollout_correction")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--steps", type=int, default=DemoSettings().grpo_steps)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--seed", type=int, default=DemoSettings().seed, help="the GRPO stage's (trainer.seed)"
    )
    parser.add_argument(
        "--results", default=str(Path(__file__).parent / "results" / "rollout_correction.jsonl")
    )
    args = parser.parse_args()
    out = Path(args.out)
    if not (out / "sft").is_dir():
        run_demo(out, console=False)
    for name in args.modes.split(","):
        record = run_mode(out, name, MODES[name], args.dtype, args.steps, args.seed)
        print(json.dumps(record), flush=True)
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
