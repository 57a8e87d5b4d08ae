"""`keel report RUN_DIR`: the curves a user looks at first, as a PNG and a self-contained HTML page."""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

from keel.errors import NO_METRICS, KeelError

# (panel title, metric names drawn in it); a panel with none of its metrics in the run is left out.
PANELS = [
    ("reward", ["critic/score/mean", "critic/rewards/mean"]),
    ("held-out accuracy", ["val/*/acc"]),
    ("response length", ["response_length/mean", "response_length/max"]),
    ("entropy", ["actor/entropy"]),
    ("KL", ["actor/ppo_kl", "actor/ref_kl", "actor/kl_loss", "actor/reward_kl_penalty"]),
    ("policy loss", ["actor/pg_loss"]),
    ("value loss", ["critic/vf_loss"]),
    ("SFT loss", ["train/loss", "val/loss"]),
    ("gradient norm", ["actor/grad_norm", "critic/grad_norm", "train/grad_norm"]),
    ("step time (s)", ["timing_s/step", "timing_s/gen", "timing_s/update_actor"]),
]


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise KeelError(NO_METRICS, f"{path} does not exist")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a killed run: show the rest
            continue
    if not records:
        raise KeelError(NO_METRICS, f"{path} has no metrics yet")
    return records


def series(records: list[dict], pattern: str) -> dict[str, tuple[list[int], list[float]]]:
    """{metric name: (steps, values)} for a name or a `val/*/acc` pattern, finite values only."""
    head, _, tail = pattern.partition("*")
    found: dict[str, tuple[list[int], list[float]]] = {}
    for record in records:
        for name, value in record.items():
            matches = name == pattern if not tail else name.startswith(head) and name.endswith(tail)
            if matches and isinstance(value, (int, float)) and math.isfinite(value):
                steps, values = found.setdefault(name, ([], []))
                steps.append(record["step"])
                values.append(value)
    return found


def plot(records: list[dict], title: str, out_png: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    panels = [(name, lines) for name, keys in PANELS
              if (lines := {k: v for key in keys for k, v in series(records, key).items()})]
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.3 * rows), squeeze=False)
    for ax, (name, lines) in zip(axes.flat, panels):
        for label, (steps, values) in lines.items():
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return [name for name, _ in panels]


def write_report(run_dir: str | Path) -> tuple[Path, Path]:
    """Write report.png and report.html into the run directory; returns their paths."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    png, page = run_dir / "report.png", run_dir / "report.html"
    panels = plot(records, str(run_dir), png)
    image = base64.b64encode(png.read_bytes()).decode()
    last = records[-1]
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.5g}</td></tr>" for k, v in last.items()
                   if isinstance(v, (int, float)))
    page.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>keel report: {html.escape(str(run_dir))}</title>"
        "<style>body{font-family:sans-serif;margin:2em}td{padding:0 1em}</style></head><body>"
        f"<h1>keel report</h1><p>{html.escape(str(run_dir))}: {len(records)} records, "
        f"panels: {html.escape(', '.join(panels))}</p>"
        f"<img alt='training curves' style='max-width:100%' src='data:image/png;base64,{image}'>"
        f"<h2>last record (step {last['step']})</h2><table>{rows}</table>{samples_html(run_dir)}</body></html>")
    return png, page


def samples_html(run_dir: Path, per_step: int = 3, steps: int = 3) -> str:
    """A few samples of the last evaluations (training's when none were logged), multi-turn ones
    turn by turn: what the model wrote, what its tools answered."""
    path = run_dir / "samples.jsonl"
    if not path.exists():
        return ""
    samples = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    chosen = [s for s in samples if s.get("split") == "val"] or samples
    by_step: dict[int, list[dict]] = {}
    for sample in chosen:
        by_step.setdefault(sample["step"], []).append(sample)
    parts = []
    for step in sorted(by_step)[-steps:]:
        parts.append(f"<h3>step {step}</h3>")
        for sample in by_step[step][:per_step]:
            turns = sample.get("conversation") or [{"role": "assistant", "content": sample.get("response", "")}]
            body = "".join(f"<p><b>{html.escape(t['role'])}</b>: <code>{html.escape(str(t['content']))}</code></p>"
                           for t in turns)
            parts.append(f"<div style='border-left:3px solid #ccc;padding-left:1em;margin:1em 0'>"
                         f"<p><b>prompt</b>: <code>{html.escape(str(sample.get('prompt', '')))}</code></p>{body}"
                         f"<p>score {sample.get('score', float('nan')):.3g}</p></div>")
    return f"<h2>samples{' (evaluation)' if chosen is not samples else ''}</h2>" + "".join(parts)
