"""CPU threads for torch, chosen for the cores other processes leave free.

torch runs one OpenMP thread per core. When other busy processes share those cores, every parallel
region ends at a barrier waiting for a sibling thread the scheduler has preempted: on 2 cores with
two busy neighbours the CPU demo's GRPO step took 8-25 times as long as alone. While a run trains
on the CPU, keel measures at each step how much of its cores other processes used during the last
one (the cores' busy time in /proc/stat, less this process's own) and gives torch the cores left
(at least one). `KEEL_CPU_THREADS`: `auto` (this, the default), `fixed` (torch's own choice,
whatever else runs; the default where OMP_NUM_THREADS is set) or a number of threads. The thread
count changes the order of some floating-point sums, so on a machine whose load changes a run's
last bits do too; a fixed count keeps a run exactly repeatable.

Measured at step boundaries from the training thread itself: a sampling thread would take the GIL
from the training thread, and on a loaded machine a preempted holder stalls it (25% of a step).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from keel.errors import BAD_VALUE, KeelError

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
FIRST_LOOK_S = 0.1  # before the first step: what the other processes use while this one waits


def busy_seconds(cpus: set[int]) -> float | None:
    """CPU-seconds the given cores have spent busy since boot, by anyone (None without /proc)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
            total += user + nice + system + irq + softirq + steal
    return total / CLOCK_TICKS


def own_seconds() -> float:
    """CPU-seconds this process has used, every thread of it."""
    t = os.times()
    return t.user + t.system


class CpuThreads:
    """`adjust()` at each step sets torch's thread count for what other processes used since the last call."""

    def __init__(self, policy: str | None = None):
        self.policy = policy or os.environ.get("KEEL_CPU_THREADS") or ("fixed" if "OMP_NUM_THREADS" in os.environ
                                                                         else "auto")
        if self.policy not in ("auto", "fixed") and not (self.policy.isdigit() and int(self.policy) > 0):
            raise KeelError(BAD_VALUE, f"KEEL_CPU_THREADS={self.policy!r} is not auto, fixed or a number of threads",
                            "unset it, or `export KEEL_CPU_THREADS=auto` (threads for the cores other processes "
                            "leave free)")
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        self.initial = torch.get_num_threads()  # restored by close(): the process outlives the run
        self.last = self._reading()
        if self.policy == "auto" and self.last is not None:
            time.sleep(FIRST_LOOK_S)

    def _reading(self) -> tuple[float, float, float] | None:
        busy = busy_seconds(self.cpus) if self.policy == "auto" and len(self.cpus) > 1 else None
        return None if busy is None else (time.monotonic(), busy, own_seconds())

    def others(self) -> float | None:
        """Cores' worth of CPU that other processes used since the last reading."""
        now = self._reading()
        if now is None or self.last is None or now[0] - self.last[0] < FIRST_LOOK_S:  # /proc/stat counts 10 ms ticks
            return None
        (t0, busy0, own0), (t1, busy1, own1) = self.last, now
        self.last = now
        return max(0.0, ((busy1 - busy0) - (own1 - own0)) / (t1 - t0))

    def adjust(self) -> int:
        """torch's thread count for the next step -> that count."""
        if self.policy.isdigit():
            torch.set_num_threads(int(self.policy))
        else:
            others = self.others()
            if others is not None:
                torch.set_num_threads(min(max(round(len(self.cpus) - others), 1), len(self.cpus)))
        return torch.get_num_threads()

    def close(self) -> None:
        torch.set_num_threads(self.initial)
