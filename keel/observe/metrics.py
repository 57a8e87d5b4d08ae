"""Where metrics go: metrics.jsonl always, the console when asked, and samples.jsonl."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from torch.profiler import record_function

# Shown in the one-line summary after each step, in this order, when present.
SUMMARY_KEYS = (
    "train/loss",
    "val/loss",
    "critic/score/mean",
    "distill/reverse_kl",
    "distill/gkd_loss",
    "actor/pg_loss",
    "actor/entropy",
    "actor/ppo_kl",
    "actor/grad_norm",
    "critic/vf_loss",
    "response_length/mean",
    "timing_s/step",
)


class Timer:
    """Wall time per named phase, reported as `timing_s/<phase>`; a phase running past `deadline_s`
    dumps every stack and exits (keel.observe.guards.phase_deadline)."""

    def __init__(self, deadline_s: float | None = None, on_phase=None):
        """`on_phase(name)`: told as each phase but the whole step starts (the progress bar shows
        it)."""
        self.times: dict[str, float] = {}
        self.deadline_s = deadline_s
        self.on_phase = on_phase

    @contextmanager
    def __call__(self, phase: str):
        from keel.observe.guards import phase_deadline

        if self.on_phase is not None and phase != "step":
            self.on_phase(phase)
        start = time.perf_counter()
        # record_function: the phase is a named range in profiles (`keel bench --profile`)
        try:
            with (
                phase_deadline(phase, self.deadline_s if phase != "step" else None),
                record_function(phase),
            ):
                yield
        finally:
            self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.times.items()}


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        # JSON has no NaN; keep it visible rather than dropping the line
        return str(value)
    return value


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop records after `last_step` (a resumed run redoes those steps), atomically."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        # a line half-written when the process was killed
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= last_step:
            kept.append(line)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def last_logged_metrics(path: Path, step: int) -> dict[str, float]:
    """What metrics.jsonl holds for `step` (its training record and its validation): a finished run
    asked to run again returns its last numbers, not an empty dict."""
    metrics: dict[str, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            # a line half-written when a process was killed
            except json.JSONDecodeError:
                continue
            if record.get("step") == step:
                metrics.update({k: v for k, v in record.items() if k != "step"})
    return metrics


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        console: bool,
        total_steps: int,
        start_step: int,
        desc: str = "keel train",
        trackers=None,
    ):
        """`trackers`: keel.observe.sinks.Trackers, written after metrics.jsonl."""
        self.metrics_path = run_dir / "metrics.jsonl"
        self.samples_path = run_dir / "samples.jsonl"
        self.console = console
        self.trackers = trackers
        self.bar = None
        if console:
            from tqdm import tqdm

            # No bar when stderr is a log file: carriage returns would bury the summary lines.
            self.bar = tqdm(
                total=total_steps,
                initial=start_step,
                desc=desc,
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
                disable=not sys.stderr.isatty(),
            )
        self._ticking, self._ticker = threading.Event(), None
        self._log_above_bar = contextlib.ExitStack()
        # a terminal: the bar's clock runs within a step too
        if self.bar is not None and not self.bar.disable:
            from tqdm.contrib.logging import logging_redirect_tqdm

            # its own handler (keel.train), or the root's (the CLI)
            keel_log = logging.getLogger("keel")
            self._log_above_bar.enter_context(
                logging_redirect_tqdm([keel_log if keel_log.handlers else logging.root])
            )
            self._ticker = threading.Thread(target=self._tick, name="keel-progress", daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        while not self._ticking.wait(1.0):
            self.bar.refresh()

    def phase(self, name: str) -> None:
        """Show the phase a step is in (gen, reward, update_actor, validate, ...) beside the bar."""
        if self.bar is not None and not self.bar.disable:
            self.bar.set_postfix_str(name)

    @classmethod
    def for_run(
        cls, cfg, run_dir: Path, total_steps: int, start_step: int, desc: str = "keel train"
    ) -> MetricsLogger:
        """The logger a run's `trainer` section asks for: console, and the trackers it names."""
        from keel.config.load import to_dict
        from keel.observe.sinks import Trackers

        t = cfg.trainer
        trackers = Trackers(t.logger, t.project_name, t.experiment_name, to_dict(cfg), run_dir)
        return cls(
            run_dir,
            "console" in t.logger,
            total_steps,
            start_step,
            desc,
            trackers if trackers.sinks else None,
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.trackers is not None:
            metrics = {**metrics, "tracking/failed_writes": float(self.trackers.failed_writes)}
        append_jsonl(self.metrics_path, {"step": step, **metrics})
        if self.trackers is not None:
            self.trackers.log(step, metrics)
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
        self.write(summary_line(step, metrics))

    def log_samples(self, step: int, samples: list[dict]) -> None:
        for sample in samples:
            append_jsonl(self.samples_path, {"step": step, **sample})

    def write(self, text: str) -> None:
        """Print above the progress bar without breaking it."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)

    def log_table(self, step: int, name: str, rows: list[dict]) -> None:
        """Rows (validation generations) to the trackers."""
        if self.trackers is not None:
            self.trackers.log_table(step, name, rows)

    def close(self) -> None:
        self._ticking.set()
        if self._ticker is not None:
            # no refresh after the bar's last draw
            self._ticker.join()
        self._log_above_bar.close()
        if self.bar is not None:
            self.bar.close()
        if self.trackers is not None:
            self.trackers.close()


def summary_line(step: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step}"]
    parts += [
        f"{k.split('/', 1)[-1] if k.startswith('actor/') else k}={metrics[k]:.4g}"
        for k in SUMMARY_KEYS
        if k in metrics
    ]
    parts += [
        f"{k}={v:.3f}" for k, v in metrics.items() if k.startswith("val/") and k.endswith("/acc")
    ]
    return " | ".join(parts)
