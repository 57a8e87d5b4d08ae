"""Timing a GPU workload as the engine runs it: captured once in a CUDA graph and replayed, so
Python's launch time is not counted (a kernel timed alone from Python measures its launch)."""

import torch


def graph_seconds(fn, reps: int = 20) -> float:
    """Seconds per replay of a CUDA graph of fn()."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # compiles the kernels outside capture
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps
