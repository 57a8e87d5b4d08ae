"""`keel report RUN_DIR`: the curves a user looks at first, as a PNG and a self-contained HTML
page."""

from __future__ import annotations

import base64
import fnmatch
import html
import json
import math
from pathlib import Path

from keel.errors import NO_METRICS, KeelError

# (panel title, metric names drawn in it); a panel with none of its metrics in the run is left out.
PANELS = [
    ("reward", ["critic/score/mean", "critic/rewards/mean"]),
    ("held-out accuracy", ["val/*/acc"]),
    # the tools demo's scorer says whether a calculator call returned the right product
    ("correct tool calls (held-out)", ["val-aux/*/correct_call/mean@*"]),
    ("response length", ["response_length/mean", "response_length/max"]),
    ("entropy", ["actor/entropy"]),
    # how far each update moved the policy from the one that sampled the batch (PPO's ratio)
    ("PPO KL (update vs rollout policy)", ["actor/ppo_kl"]),
    # the drift the KL loss or KL reward holds back; only runs with a reference log these
    ("KL to the reference model", ["actor/ref_kl", "actor/kl_loss", "actor/reward_kl_penalty"]),
    ("policy loss", ["actor/pg_loss"]),
    ("value loss", ["critic/vf_loss"]),
    # SFT's, DPO's or a reward model's
    ("loss", ["train/loss", "val/loss"]),
    # preference training (TRL's names): the share of pairs ranked right, and by how much
    ("pairs ranked right", ["rewards/accuracies", "val/rewards/accuracies"]),
    ("reward margin (chosen - rejected)", ["rewards/margins", "val/rewards/margins"]),
    ("completion log-probs", ["logps/chosen", "logps/rejected"]),
    # on-policy distillation: the student's reverse KL to the teacher on its own samples
    ("reverse KL to the teacher", ["distill/reverse_kl", "distill/gkd_loss"]),
    ("log-prob of the student's tokens", ["distill/teacher_log_prob", "distill/student_log_prob"]),
    ("gradient norm", ["actor/grad_norm", "critic/grad_norm", "train/grad_norm"]),
    ("step time (s)", ["timing_s/step", "timing_s/gen", "timing_s/update_actor"]),
]


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise KeelError(NO_METRICS, f"{path} does not exist", _run_dir_below(run_dir))
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        # a line cut short by a killed run: show the rest
        except json.JSONDecodeError:
            continue
    if not records:
        raise KeelError(NO_METRICS, f"{path} has no metrics yet")
    return records


def _run_dir_below(path: Path) -> str | None:
    """The fix for a directory that is not a run's: the one run directory below it (checkpoints/ or
    a project's folder), as a command; None (the catalogue's fix) when there are none or several."""
    found = sorted(
        p.parent for p in path.glob("**/metrics.jsonl") if len(p.relative_to(path).parts) <= 4
    )
    if len(found) != 1:
        return None
    return f"run `keel report {found[0]}` (the run directory below {path})"


def series(records: list[dict], pattern: str) -> dict[str, tuple[list[int], list[float]]]:
    """{metric name: (steps, values)} for a name or a `val/*/acc` pattern, finite values only."""
    found: dict[str, tuple[list[int], list[float]]] = {}
    for record in records:
        for name, value in record.items():
            if (
                fnmatch.fnmatchcase(name, pattern)
                and isinstance(value, (int, float))
                and math.isfinite(value)
            ):
                steps, values = found.setdefault(name, ([], []))
                steps.append(record["step"])
                values.append(value)
    return found


def panel_lines(
    records: list[dict],
) -> list[tuple[str, list[tuple[str, list[int], list[float], str]]]]:
    """[(panel title, [(legend label, steps, values, line style)])], the panels the run has metrics
    for. A curve equal to one drawn before it in its panel (critic/rewards/mean is critic/score/mean
    without a KL penalty) would hide under it: it is dashed, and its label says which it equals."""
    panels = []
    for title, keys in PANELS:
        drawn: dict[tuple, str] = {}
        lines = []
        for key in keys:
            for label, (steps, values) in series(records, key).items():
                same = drawn.setdefault((tuple(steps), tuple(f"{v:.6g}" for v in values)), label)
                lines.append(
                    (label, steps, values, "-")
                    if same == label
                    else (f"{label} (= {same})", steps, values, "--")
                )
        if lines:
            panels.append((title, lines))
    return panels


def plot(records: list[dict], title: str, out_png: Path) -> list[str]:
    import matplotlib

    # no display on servers
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = panel_lines(records)
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.3 * rows), squeeze=False)
    for ax, (name, lines) in zip(axes.flat, panels):
        for label, steps, values, style in lines:
            ax.plot(
                steps,
                values,
                style,
                marker="o" if len(steps) < 30 else None,
                markersize=3,
                label=label,
            )
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return [name for name, _ in panels]


def display_name(run_dir: Path) -> str:
    """The run directory as the user named it: a relative path as given, an absolute one relative
    to the working directory when inside it, else its last two parts (a temporary or home
    directory's prefix says nothing about the run)."""
    if not run_dir.is_absolute():
        return str(run_dir)
    try:
        return str(run_dir.relative_to(Path.cwd()))
    except ValueError:
        return str(Path("...", *run_dir.parts[-2:]))


def write_report(run_dir: str | Path) -> tuple[Path, Path]:
    """Write report.png and report.html into the run directory; returns their paths."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    png, page = run_dir / "report.png", run_dir / "report.html"
    name = display_name(run_dir)
    panels = plot(records, name, png)
    image = base64.b64encode(png.read_bytes()).decode()
    last = records[-1]
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{v:.5g}</td></tr>"
        for k, v in last.items()
        if isinstance(v, (int, float))
    )
    page.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>keel report: "
        f"{html.escape(name)}</title><style>body{{font-family:sans-serif;margin:2em}}td{{padding:0 "
        f"1em}}</style></head><body><h1>keel report</h1><p>{html.escape(name)}: {len(records)} "
        f"records, panels: {html.escape(', '.join(panels))}</p><img alt='training curves' "
        f"style='max-width:100%' src='data:image/png;base64,{image}'><h2>last record (step "
        f"{last['step']})</h2><table>{rows}</table>{samples_html(run_dir)}</body></html>"
    )
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
            turns = sample.get("conversation") or [
                {"role": "assistant", "content": sample.get("response", "")}
            ]
            body = "".join(
                f"<p><b>{html.escape(t['role'])}</b>: "
                f"<code>{html.escape(str(t['content']))}</code></p>"
                for t in turns
            )
            parts.append(
                "<div style='border-left:3px solid #ccc;padding-left:1em;margin:1em "
                "0'><p><b>prompt</b>: "
                f"<code>{html.escape(str(sample.get('prompt', '')))}</code></p>{body}<p>score "
                f"{sample.get('score', float('nan')):.3g}</p></div>"
            )
    return f"<h2>samples{' (evaluation)' if chosen is not samples else ''}</h2>" + "".join(parts)
