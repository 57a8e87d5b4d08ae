"""torch's OpenMP threads wait for each other by sleeping, not spinning: set before torch loads.

At the end of every parallel region torch's CPU threads wait for their siblings, and by libgomp's
default a waiting thread spins first. On a machine other processes share, the sibling is often
the one preempted, and the spinning burns the time slice it needs: beside two busy processes the
CPU demo's GRPO step took 3.4 and 11.8 times as long as alone on 2 cores; with sleeping waits 1.35
and 2.0 times, for up to a tenth more alone (benchmarks/cpu_contention.py, two runs of each; the
table in benchmarks/README.md). The thread count
stays torch's, so a run's numbers do not depend on the load. libgomp reads the policy once, when
torch loads it, so keel sets it on import: unless the user chose one (OMP_WAIT_POLICY or
GOMP_SPINCOUNT set), or torch was imported first (`keel doctor` and `keel train` on the CPU say so).
"""

import os
import sys

USER_CHOICE = next(
    (
        f"{name}={os.environ[name]}"
        for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
        if name in os.environ
    ),
    None,
)
TORCH_CAME_FIRST = "torch" in sys.modules
if USER_CHOICE is None and not TORCH_CAME_FIRST:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def how_threads_wait() -> tuple[bool, str]:
    """(whether waits are as keel means them, what they are and why) for this process."""
    if USER_CHOICE is not None:
        return True, f"as set: {USER_CHOICE}"
    if TORCH_CAME_FIRST:
        return False, (
            "spinning: torch was imported before keel; on a shared machine a CPU run slows "
            "several times over, so `export OMP_WAIT_POLICY=PASSIVE` before Python starts, or "
            "import keel first"
        )
    return (
        True,
        "sleeping (OMP_WAIT_POLICY=PASSIVE, set by keel): a CPU run keeps its pace beside "
        "busy processes",
    )
