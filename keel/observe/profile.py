"""`keel bench --profile`: a rank's work under torch.profiler, written as a kernel and phase table,
and how busy the GPU was in each phase."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


class RankProfile:
    def __init__(self, device: torch.device):
        self.device = device
        cuda = [ProfilerActivity.CUDA] if device.type == "cuda" else []
        self.profiler = profile(activities=[ProfilerActivity.CPU] + cuda)
        self.profiler.__enter__()

    def stop(self, path: str | None) -> dict[str, dict[str, float]]:
        """Ends the profile; writes the table to `path` when given. Returns, per named phase, the
        GPU's busy share of its profiled wall time ("busy") and the seconds the GPU was busy in it
        ("gpu_s"); both empty on CPU."""
        self.profiler.__exit__(None, None, None)
        gpu = self.device.type == "cuda"
        events = self.profiler.events()
        gpu_s = phase_gpu_seconds(events) if gpu else {}
        busy = phase_busy(events) if gpu else {}
        if path:
            sort = "cuda_time_total" if gpu else "cpu_time_total"
            table = self.profiler.key_averages().table(
                sort_by=sort, row_limit=60, max_name_column_width=90
            )
            gaps = "".join(f"{json.dumps(gap)}\n" for gap in idle_gaps(events)) if gpu else ""
            kernels = (
                "".join(f"{json.dumps(row)}\n" for row in phase_kernels(events)) if gpu else ""
            )
            Path(path).write_text(
                f"GPU busy per phase: {json.dumps(busy)}\n\nLongest GPU idle gaps (ms; the host's "
                f"innermost op at the gap's middle):\n{gaps}\nEach phase's costliest kernels "
                f"(ms in the phase, launches):\n{kernels}\n{table}"
            )
        return {"busy": busy, "gpu_s": gpu_s}


# named on every rank
WORKER_PHASES = ("worker/generate", "worker/compute_log_probs", "worker/update_actor")


def _is_activity(e) -> bool:
    """The device ran something: a kernel, a copy, a fill (not its own annotation spans)."""
    return e.device_type == DeviceType.CUDA and not e.is_user_annotation


def _is_phase(e) -> bool:
    """A named range of the host's: keel's timer phases, the workers' methods."""
    return e.device_type == DeviceType.CPU and e.is_user_annotation


def idle_gaps(
    events, phases: tuple[str, ...] = WORKER_PHASES, top: int = 12, min_length: float = 100.0
) -> list[dict]:
    """The longest stretches of `phases` (at least `min_length`, in the profiler's microseconds) in
    which the GPU ran nothing: where it waited on the host. Each says its phase, when it began (ms
    into the phase), its length (ms), the device's last activity before and first after it, and
    the host's innermost operator at its middle ("python" when none: the interpreter between
    operators), which is what the GPU waited for."""
    activity = sorted(
        (e.time_range.start, e.time_range.end, e.name) for e in events if _is_activity(e)
    )
    gaps = []
    for phase in (e for e in events if _is_phase(e) and e.name in phases):
        start, end = phase.time_range.start, phase.time_range.end
        reach, before = start, "(phase start)"
        for lo, hi, name in activity + [(end, end, "(phase end)")]:
            if hi <= reach:
                continue
            if min(lo, end) - reach >= min_length:
                gaps.append(
                    (
                        min(lo, end) - reach,
                        phase.name,
                        start,
                        reach,
                        before,
                        name if lo < end else "(phase end)",
                        phase.thread,
                    )
                )
            if lo >= end:
                break
            reach, before = max(reach, hi), name
    host_ops = [e for e in events if e.device_type == DeviceType.CPU and not e.is_user_annotation]
    return [
        {
            "phase": phase,
            "at_ms": round((at - start) / 1e3, 3),
            "ms": round(length / 1e3, 3),
            "after": after,
            "before": following,
            "host": _innermost(host_ops, thread, at + length / 2),
        }
        for length, phase, start, at, after, following, thread in sorted(
            gaps, key=lambda gap: -gap[0]
        )[:top]
    ]


def phase_kernels(
    events, phases: tuple[str, ...] = WORKER_PHASES, top: int = 25, name_width: int = 90
) -> list[dict]:
    """Per phase, the `top` kernels (and copies, fills) by the GPU time they took in it, each
    name's launches summed: what a phase's time is made of, which the whole step's table mixes
    (the old-log-prob pass's GEMMs with the update's)."""
    spans = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in events
        if _is_phase(e) and e.name in phases
    ]
    totals: dict[tuple[str, str], list[float]] = {}
    for e in filter(_is_activity, events):
        for phase, start, end in spans:
            if start <= e.time_range.start < end:
                entry = totals.setdefault((phase, e.name[:name_width]), [0.0, 0])
                entry[0] += e.time_range.end - e.time_range.start
                entry[1] += 1
    by_phase: dict[str, list[dict]] = {}
    for (phase, name), (micros, launches) in totals.items():
        row = {"phase": phase, "ms": round(micros / 1e3, 3), "n": launches, "kernel": name}
        by_phase.setdefault(phase, []).append(row)
    return [
        row
        for phase in sorted(by_phase)
        for row in sorted(by_phase[phase], key=lambda row: -row["ms"])[:top]
    ]


def _innermost(ops, thread: int, moment: float) -> str:
    """The innermost operator the phase's thread was running at `moment` (autograd's own thread
    runs backward beside it)."""
    around = [
        e for e in ops if e.thread == thread and e.time_range.start <= moment < e.time_range.end
    ]
    innermost = max(around, key=lambda e: (e.time_range.start, -e.time_range.end), default=None)
    return innermost.name if innermost else "python"


def phase_busy(events) -> dict[str, float]:
    """For each named range (keel's timer phases, the workers' methods): the share of its wall
    time in which the GPU was running something (a kernel, a copy, a fill), i.e. the union of the
    device's activity intervals inside the range over the range's length. A phase that occurs
    more than once is pooled. The device's own annotation spans are not activity."""
    covered, wall = _phase_times(events)
    return {name: round(covered[name] / wall[name], 4) for name in covered if wall[name] > 0}


def phase_gpu_seconds(events) -> dict[str, float]:
    """Seconds the GPU was busy in each named range (pooled like phase_busy). The profiler slows
    the host, not the GPU's work, so these over a phase's unprofiled wall time say how busy the GPU
    is in a run as it normally goes."""
    covered, _ = _phase_times(events)
    # the profiler counts microseconds
    return {name: seconds / 1e6 for name, seconds in covered.items()}


def _phase_times(events) -> tuple[dict[str, float], dict[str, float]]:
    """(device-busy time, wall time) per named range, in the profiler's microseconds."""
    activity = sorted((e.time_range.start, e.time_range.end) for e in events if _is_activity(e))
    covered: dict[str, float] = {}
    wall: dict[str, float] = {}
    for e in events:
        if _is_phase(e):
            start, end = e.time_range.start, e.time_range.end
            covered[e.name] = covered.get(e.name, 0.0) + covered_time(activity, start, end)
            wall[e.name] = wall.get(e.name, 0.0) + (end - start)
    return covered, wall


def covered_time(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Length of the union of sorted `intervals` (start, end) clipped to [start, end]."""
    total, reach = 0.0, start
    for lo, hi in intervals:
        if lo >= end:
            break
        lo, hi = max(lo, reach), min(hi, end)
        if hi > lo:
            total += hi - lo
            reach = hi
    return total
