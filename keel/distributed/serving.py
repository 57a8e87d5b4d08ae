"""A worker's side of every driver call, whatever the worker builds (policy and critic ranks,
reward model replicas): the phase is recorded for stack dumps, faults can be injected for tests,
and each result comes back with the call's time and a memory reading whose GPU peak is the call's.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import record_function

from keel.distributed.dist import memory_reading
from keel.distributed.faults import maybe_inject
from keel.errors import COMPILE_FAILED, KeelError
from keel.errors.fixes import overrides


@dataclass
class Reply:
    result: Any
    # memory_reading after the call: rss_gb, and gpu_*_gb on a GPU
    memory: dict[str, float]
    # the call's own time on the worker
    seconds: float


def _eager_fix(method: str) -> str:
    """Training compiles the decoder layers (actor.use_torch_compile); generation may run them, or
    the native engine's own compiled decode step (rollout.enforce_eager)."""
    keys = {"actor_rollout_ref.actor.use_torch_compile": False}
    if method == "generate":
        keys["actor_rollout_ref.rollout.enforce_eager"] = True
    return f"set {overrides(keys)} (the same numbers uncompiled, slower)"


class ServedWorker:
    def __init__(self, worker, rank: int = 0, device: torch.device | None = None):
        self.worker, self.rank = worker, rank
        self.device = device or getattr(worker, "device", torch.device("cpu"))
        self.phase = "idle"
        self.phase_thread = threading.main_thread().ident

    def run(self, method: str, *args) -> Reply:
        self.phase = method
        # Ray runs calls on a thread of its own, not main
        self.phase_thread = threading.get_ident()
        maybe_inject(method, self.rank)
        # the reading's peak is this call's
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        try:
            # a named range in a rank's profile (keel bench --profile)
            with record_function(f"worker/{method}"):
                result = getattr(self.worker, method)(*args)
        except Exception as error:
            if is_compile_error(error):
                raise KeelError(
                    COMPILE_FAILED,
                    f"torch.compile failed in {method}: {_first_lines(str(error))}",
                    _eager_fix(method),
                ) from error
            raise
        self.phase = "idle"
        return Reply(result, memory_reading(self.device), time.perf_counter() - start)

    def describe(self) -> Reply:
        """Where this rank runs and what the worker says of itself (its `info`), with the memory it
        holds once built."""
        own = self.worker.info() if hasattr(self.worker, "info") else {}
        where = {
            "rank": self.rank,
            "pid": os.getpid(),
            "device": str(self.device),
            "threads": torch.get_num_threads(),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES", "all"),
            **own,
        }
        return Reply(where, memory_reading(self.device), 0.0)

    def stacks(self) -> dict:
        """Every thread's stack, and whether the thread running the phase waits in a collective."""
        text, in_collective = [], False
        for ident, frame in sys._current_frames().items():
            stack = "".join(traceback.format_stack(frame))
            busy = ident == self.phase_thread
            if busy:
                in_collective = "torch/distributed" in stack
            text.append(
                f"--- thread {ident}{' (phase ' + self.phase + ')' if busy else ''} ---\n{stack}"
            )
        return {"phase": self.phase, "in_collective": in_collective, "text": "\n".join(text)}


def is_compile_error(error: BaseException) -> bool:
    """An error raised by torch.compile: dynamo's own (a backend failure among them) or, on
    releases that raise it unwrapped, inductor's."""
    from torch._dynamo.exc import TorchDynamoException

    try:
        from torch._inductor.exc import InductorError
    # older torch: inductor failures arrive wrapped in dynamo's
    except ImportError:
        InductorError = TorchDynamoException
    return isinstance(error, (TorchDynamoException, InductorError))


def _first_lines(text: str, count: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[:count])
