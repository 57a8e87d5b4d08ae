"""A demo's table: what a finished run reports (held-out accuracy before and after GRPO, steps,
time, size), kept in its directory so that a rerun shows it again instead of training."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

# a finished demo's table: a rerun shows it again instead of training
RESULT = "result.json"


@dataclass
class DemoResult:
    out_dir: Path
    # held-out accuracy of the SFT model (greedy)
    acc_before: float
    # after GRPO
    acc_after: float
    sft_steps: int
    grpo_steps: int
    seconds: float
    n_params: int
    # the tools demo: share of held-out calls that gave the right answer
    calls_before: float | None = None
    calls_after: float | None = None
    smoke: bool = False
    # read back from RESULT: the demo had finished before this run
    earlier: bool = False


def val_metric(run_dir: Path, step: int, key: str) -> float:
    """A held-out metric logged at `step` (0: before any GRPO update)."""
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["step"] == step and key in record:
            return record[key]
    raise ValueError(f"no {key} at step {step} in {run_dir}")


def stored_result(out: Path) -> DemoResult | None:
    """The table of a demo that finished in `out` (same settings: prepare_out_dir cleared any
    other)."""
    try:
        stored = json.loads((out / RESULT).read_text())
    # none yet (or cut short by a killed run): run the demo
    except (OSError, ValueError):
        return None
    values = {f.name: stored[f.name] for f in fields(DemoResult) if f.name in stored}
    values.update(out_dir=out, earlier=True)
    try:
        return DemoResult(**values)
    # written by a keel whose table had other fields: run the demo
    except TypeError:
        return None


def print_summary(r: DemoResult) -> None:
    gain = 100 * (r.acc_after - r.acc_before)
    rows = [
        ("held-out accuracy after SFT", f"{100 * r.acc_before:.1f}%"),
        ("held-out accuracy after GRPO", f"{100 * r.acc_after:.1f}%  ({gain:+.1f} points)"),
        ("steps", f"SFT {r.sft_steps}, GRPO {r.grpo_steps}"),
        ("wall time", f"{r.seconds / 60:.1f} min" + (" (when it ran)" if r.earlier else "")),
        ("run directories", f"{r.out_dir / 'sft'}  {r.out_dir / 'grpo'}"),
        ("plots", f"{r.out_dir / 'grpo' / 'report.png'}  {r.out_dir / 'sft' / 'report.png'}"),
    ]
    if r.calls_before is not None:
        rows.insert(
            2,
            (
                "correct calculator calls",
                f"{100 * r.calls_before:.1f}% -> {100 * r.calls_after:.1f}%",
            ),
        )
    width = max(len(label) for label, _ in rows)
    task = (
        "3-digit multiplication with a calculator tool"
        if r.calls_before is not None
        else "2-digit addition"
    )
    print(f"\nkeel demo: {task}, a {r.n_params / 1e6:.1f}M-parameter Qwen2 trained on CPU")
    if r.smoke:
        print(
            "  smoke run (--smoke): a few steps of each stage to check the setup; the numbers "
            "mean nothing"
        )
    if r.earlier:
        print(f"  finished earlier in {r.out_dir}; `keel demo --fresh` runs it again")
    for label, value in rows:
        print(f"  {label:<{width}}  {value}")
