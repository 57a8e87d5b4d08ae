"""How the batcher's decode steps become CUDA graphs, and the clock that times each part of a
generation."""

from __future__ import annotations

import time

import torch


def capture(step_fn, pool=None) -> torch.cuda.CUDAGraph:
    """`step_fn` captured as a CUDA graph (run once on a side stream first, as capture requires:
    allocator and kernel selection). The warm-up's effects are the caller's to undo."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step_fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: a tool or environment running on another thread (the agent loop overlaps them
    # with decoding) may use CUDA while a bucket's graph is captured.
    # recorded, not run
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        step_fn()
    return graph


class Clock:
    """Seconds per part of a generate call (synchronised on GPU), kept as engine.timing."""

    def __init__(self, device: torch.device):
        self.device = device
        self.laps: dict[str, float] = {}
        self.last = self._now()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, name: str) -> None:
        now = self._now()
        self.laps[name] = self.laps.get(name, 0.0) + now - self.last
        self.last = now
