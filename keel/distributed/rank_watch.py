"""How the driver waits on a Ray group's ranks, and what it says when one fails: a worker's
exception (with its traceback), a worker the system killed (with its last memory reading), or a
phase that stalled (with every rank's stacks on disk and the ranks that never reached the
collective named). Each becomes a KeelError that names the rank, host, role and phase."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from keel.errors import PHASE_STALLED, WORKER_DIED, WORKER_RAISED, KeelError

PEER_LOST = (
    "connection reset by peer",
    "connection closed by peer",
    "remote process exited",
    "broken pipe",
)
# how long a rank's lost peer has to show up as a death before the rank's error stands
PEER_DEATH_WAIT_S = 30.0

STACKS_TIMEOUT_S = 15.0


class RankWatch:
    """The ranks of one group, watched: their replies in rank order, or the first failure as a
    KeelError, after `shutdown` ended the group (the other ranks would only block in a collective
    until it times out)."""

    def __init__(
        self,
        world_size: int,
        role: str,
        stacks_dir: Path,
        actors: list,
        shutdown: Callable[[], None],
    ):
        self.world_size, self.role, self.stacks_dir = world_size, role, stacks_dir
        # the group's Ray actors, in rank order (the group's own list: emptied when it shuts down)
        self.actors = actors
        self.shutdown = shutdown
        # rank -> its reading after its last call: for _died
        self.last_memory: dict[int, dict] = {}
        self.hosts: dict[int, str] = {}

    def wait(self, refs: list, phase: str, ranks: list[int], timeout_s: float | None) -> list:
        """Results in rank order; the first failure ends the wait (the other ranks would only
        block in a collective until it times out)."""
        import ray
        from ray.exceptions import RayError, RayTaskError

        pending = dict(zip(refs, ranks))
        results: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s if timeout_s else None
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=remaining)
            if not ready:
                raise self._stalled(
                    phase,
                    sorted(pending.values()),
                    f"phase {phase!r} ran past trainer.guards.phase_timeout_s={timeout_s}",
                )
            rank = pending.pop(ready[0])
            try:
                results[rank] = ray.get(ready[0])
            except RayTaskError as e:
                if _is_collective_timeout(e):
                    first_line = str(e.cause).strip().splitlines()[0][:300]
                    raise self._stalled(
                        phase,
                        sorted(pending.values()),
                        f"rank {rank}'s collective timed out after "
                        f"trainer.collective_timeout_s ({first_line})",
                    ) from None
                # a rank that died broke this one's collective: name the dead one
                if _is_peer_lost(e):
                    self._raise_if_one_died(pending, phase)
                raise self._raised(rank, phase, e) from None
            # the actor died, was killed by Ray's memory monitor, or lost its node
            except RayError as e:
                raise self._died(rank, phase, e) from None
        return [results[r] for r in ranks]

    def _raise_if_one_died(self, pending: dict, phase: str) -> None:
        """A rank whose collective lost its peer: if one of the ranks still pending died, that death
        is the run's error (the lost connection only follows from it). Waits PEER_DEATH_WAIT_S at
        most."""
        import ray
        from ray.exceptions import RayError, RayTaskError

        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=PEER_DEATH_WAIT_S)
        for ref in ready:
            try:
                ray.get(ref)
            except RayTaskError:
                continue
            except RayError as e:
                raise self._died(pending[ref], phase, e) from None

    def where(self, rank: int, phase: str) -> str:
        host = self.hosts.get(rank, "?")
        return f"rank {rank} of {self.world_size} (host {host}, role {self.role}, phase {phase})"

    def _raised(self, rank: int, phase: str, error) -> KeelError:
        self.shutdown()
        cause = getattr(error, "cause", None)
        # the worker's own diagnosis keeps its code
        if isinstance(cause, KeelError):
            return KeelError(cause.code, f"{self.where(rank, phase)}: {cause.message}", cause.fix)
        remote = str(error).strip()
        return KeelError(
            WORKER_RAISED,
            f"{self.where(rank, phase)} raised "
            f"{type(cause).__name__ if cause else 'an exception'}: {cause}\n"
            f"--- worker traceback ---\n{remote}",
        )

    def _died(self, rank: int, phase: str, error) -> KeelError:
        self.shutdown()
        memory = self.last_memory.get(rank)
        reading = (
            ", ".join(f"{k}={v:.2f}" for k, v in memory.items())
            if memory
            else "none (it died before its first call returned)"
        )
        return KeelError(
            WORKER_DIED,
            f"{self.where(rank, phase)} died without raising: killed by the system (e.g. out of "
            f"memory) or crashed in native code. Last memory reading: {reading}. Ray said: "
            f"{str(error).splitlines()[0] if str(error) else type(error).__name__}",
        )

    def _stalled(self, phase: str, waiting: list[int], why: str) -> KeelError:
        """Every rank's stacks to disk; ranks whose main thread is not inside torch.distributed
        are the ones that did not arrive."""
        import ray

        stacks = {}
        for rank, actor in enumerate(self.actors):
            try:
                stacks[rank] = ray.get(actor.stacks.remote(), timeout=STACKS_TIMEOUT_S)
            # a dead or wedged process cannot answer: say so in the dump
            except Exception as e:
                stacks[rank] = {"phase": "?", "in_collective": False, "text": f"(no stacks: {e})"}
        self.stacks_dir.mkdir(parents=True, exist_ok=True)
        path = self.stacks_dir / f"stacks_{phase}_{int(time.time())}.txt"
        path.write_text(
            "\n\n".join(
                f"===== {self.where(r, s['phase'])} =====\n{s['text']}" for r, s in stacks.items()
            )
        )
        absent = [r for r in waiting if not stacks[r]["in_collective"]]
        self.shutdown()
        return KeelError(
            PHASE_STALLED,
            f"{why}. Ranks that did not arrive: {absent or 'none identified'}; "
            f"still running: {waiting}; every rank's stacks: {path}",
        )


def _is_collective_timeout(error) -> bool:
    """A collective that gave up waiting (gloo's or NCCL's timeout), judged by the exception's
    own message: the traceback always mentions torch.distributed and timeouts."""
    message = str(getattr(error, "cause", None) or "").lower()
    return "timed out" in message or "timeout" in message


def _is_peer_lost(error) -> bool:
    """A collective whose peer went away (gloo's reset or closed connection, NCCL's remote
    error)."""
    message = str(getattr(error, "cause", None) or "").lower()
    return any(text in message for text in PEER_LOST)
