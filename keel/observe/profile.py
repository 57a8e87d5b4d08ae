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

    def stop(self, path: str | None) -> dict[str, float]:
        """Ends the profile; writes the table to `path` when given. Returns the GPU's busy share of
        each named phase (empty on CPU)."""
        self.profiler.__exit__(None, None, None)
        busy = phase_busy(self.profiler.events()) if self.device.type == "cuda" else {}
        if path:
            sort = "cuda_time_total" if self.device.type == "cuda" else "cpu_time_total"
            table = self.profiler.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=90)
            Path(path).write_text(f"GPU busy per phase: {json.dumps(busy)}\n\n{table}")
        return busy


def phase_busy(events) -> dict[str, float]:
    """For each named range (keel's timer phases, the workers' methods): the share of its wall
    time in which the GPU was running something (a kernel, a copy, a fill), i.e. the union of the
    device's activity intervals inside the range over the range's length. A phase that occurs
    more than once is pooled. The device's own annotation spans are not activity."""
    activity = sorted((e.time_range.start, e.time_range.end) for e in events
                      if e.device_type == DeviceType.CUDA and not e.is_user_annotation)
    covered: dict[str, float] = {}
    wall: dict[str, float] = {}
    for e in events:
        if e.device_type == DeviceType.CPU and e.is_user_annotation:
            start, end = e.time_range.start, e.time_range.end
            covered[e.name] = covered.get(e.name, 0.0) + covered_time(activity, start, end)
            wall[e.name] = wall.get(e.name, 0.0) + (end - start)
    return {name: round(covered[name] / wall[name], 4) for name in covered if wall[name] > 0}


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
