"""Worker groups: the driver's handle on its workers, in this process or as Ray actors.

`call(method, per_rank_args)` runs `method` on every rank with that rank's arguments and returns the
results in rank order, with each rank's time and memory reading; `submit` starts the same call and
returns a future of it, so the driver may go on (a group's ranks take their calls in the order
submitted). A failure anywhere becomes a
KeelError that names the rank, host, role and phase: a worker's exception (with its traceback), a
worker the system killed (with its last memory reading), or a phase that stalled (with every rank's
stacks on disk and the ranks that never reached the collective named).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from keel.distributed.finished import FinishedChannel
from keel.distributed.ray_cluster import Devices, connect_ray, reserve
from keel.distributed.serving import ServedWorker
from keel.errors import PHASE_STALLED, WORKER_DIED, WORKER_RAISED, KeelError

log = logging.getLogger("keel")

PEER_LOST = (
    "connection reset by peer",
    "connection closed by peer",
    "remote process exited",
    "broken pipe",
)
# how long a rank's lost peer has to show up as a death before the rank's error stands
PEER_DEATH_WAIT_S = 30.0

STACKS_TIMEOUT_S = 15.0
STARTUP_TIMEOUT_S = 600.0


class Replies(list):
    """The results of one call in rank order, with each rank's time and memory reading."""

    def __init__(self, replies: list):
        super().__init__(reply.result for reply in replies)
        self.seconds = [reply.seconds for reply in replies]
        self.memory = [reply.memory for reply in replies]


class LocalGroup:
    """One worker in the driver's process: the single-device case, with no Ray and no copies."""

    world_size = 1
    # a callable argument reaches the worker itself, not a copy
    in_process = True

    def __init__(self, worker):
        self.worker = worker
        self.served = ServedWorker(worker)

    def call(self, method: str, per_rank_args: list[tuple]) -> Replies:
        return Replies([self.served.run(method, *per_rank_args[0])])

    def submit(self, method: str, per_rank_args: list[tuple]) -> Future:
        """The call, run now (the worker is this process): a future that is already done."""
        return _done(self.call, method, per_rank_args)

    def shutdown(self) -> None:
        """The worker's helper processes (an agent rollout's) stop with the run, not with this process."""
        close = getattr(self.worker, "close", None)
        if close is not None:
            close()


class RayGroup:
    """`world_size` Ray actors, one per GPU (or CPU process with trainer.device=cpu), each serving
    the worker `build(rank, world_size, master)` makes. Ranks are placed with a PACK placement
    group, so ranks of a node are consecutive. With `rendezvous`, they form a torch.distributed
    group: rank 0's node hosts it on `port` (MASTER_PORT), or on a port it found free."""

    def __init__(
        self,
        build,
        world_size: int,
        devices: Devices,
        *,
        role: str,
        stacks_dir: Path,
        phase_timeout_s: float | None,
        rendezvous: bool = True,
        port: int | None = None,
    ):
        ray = connect_ray(devices)
        self.world_size, self.role, self.stacks_dir = world_size, role, stacks_dir
        self.phase_timeout_s = phase_timeout_s
        # rank -> its reading after its last call: for _died
        self.last_memory: dict[int, dict] = {}
        self.hosts: dict[int, str] = {}
        # what shut the group down: every later call raises it
        self.ended: KeelError | None = None
        # submitted calls not yet answered: a later call waits for them too
        self.in_flight: set[Future] = set()
        # samples told as they finish (generate's on_finished)
        self.channel: FinishedChannel | None = None
        self.placement, cpus = reserve(ray, devices, world_size)
        # a cluster's workers lack our env
        env = {k: v for k, v in os.environ.items() if k.startswith("KEEL_")}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_class = _worker_actor_class(ray)
        self.actors = [
            actor_class.options(
                # a rank runs its calls in the order sent (versions rely on it)
                allow_out_of_order_execution=False,
                num_cpus=cpus,
                num_gpus=1 if devices.gpus else 0,
                runtime_env={"env_vars": env} if env else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(world_size)
        ]
        ranks = list(range(world_size))
        self.hosts = dict(
            zip(
                ranks,
                self._wait(
                    [a.hostname.remote() for a in self.actors], "setup", ranks, STARTUP_TIMEOUT_S
                ),
            )
        )
        master = None
        if rendezvous:
            master = self._wait(
                [self.actors[0].rendezvous.remote(port)], "setup", [0], STARTUP_TIMEOUT_S
            )[0]
            log.info("%s ranks meet at %s:%d%s", role, *master, " (MASTER_PORT)" if port else "")
        # CPU ranks share their node's cores
        split_cores = rendezvous and not devices.gpus
        self._wait(
            [
                a.setup.remote(build, rank, world_size, master, split_cores)
                for rank, a in enumerate(self.actors)
            ],
            "setup",
            ranks,
            STARTUP_TIMEOUT_S,
        )
        described = self._wait(
            [a.describe.remote() for a in self.actors], "setup", ranks, STARTUP_TIMEOUT_S
        )
        # what a rank held before its first call
        self.last_memory.update(enumerate(reply.memory for reply in described))
        self._log_ranks([reply.result for reply in described])

    def _log_ranks(self, described: list[dict]) -> None:
        """Where each rank runs, as it describes itself once set up."""
        for info in described:
            log.info(
                "%s rank %d on %s (pid %d, %s, CUDA_VISIBLE_DEVICES=%s, %d threads)%s",
                self.role,
                info["rank"],
                self.hosts[info["rank"]],
                info["pid"],
                info["device"],
                info["visible"],
                info["threads"],
                "".join(f", {k}={v:.3f}" for k, v in info.items() if k.startswith("fsdp/")),
            )

    def call(self, method: str, per_rank_args: list[tuple]) -> Replies:
        return self._replies(method, self._send(method, per_rank_args), len(self.in_flight))

    def call_all(self, method: str, args: tuple) -> Replies:
        """The same arguments on every rank, stored once in Ray's object store (a whole model's weights)."""
        import ray

        # each rank's call reads them; none is copied per rank
        stored = tuple(ray.put(arg) for arg in args)
        return self.call(method, [stored] * self.world_size)

    def submit(self, method: str, per_rank_args: list[tuple]) -> Future:
        """The call sent to every rank now; the future holds its Replies, or the KeelError `call` raises."""
        refs, ahead = self._send(method, per_rank_args), len(self.in_flight)
        future: Future = Future()
        # set.add and set.discard are atomic: no lock with the waiting thread
        self.in_flight.add(future)

        def wait() -> None:
            try:
                future.set_result(self._replies(method, refs, ahead))
            except BaseException as error:  # noqa: BLE001 - the caller of result() gets it, as call's did
                future.set_exception(error)
            finally:
                self.in_flight.discard(future)

        threading.Thread(target=wait, name=f"keel-{self.role}-{method}", daemon=True).start()
        return future

    def finished_channel(self) -> FinishedChannel:
        """Where the ranks tell the driver of each sample as it finishes (started on first use)."""
        if self.channel is None:
            self.channel = FinishedChannel()
        return self.channel

    def _send(self, method: str, per_rank_args: list[tuple]) -> list:
        # a call after a failure shut the group down says that failure again
        if self.ended is not None:
            raise self.ended
        return [a.run.remote(method, *args) for a, args in zip(self.actors, per_rank_args)]

    def _replies(self, method: str, refs: list, ahead: int = 0) -> Replies:
        """The replies; `ahead`: calls submitted before it, which the ranks run first (each gets the
        phase timeout)."""
        timeout_s = self.phase_timeout_s * (ahead + 1) if self.phase_timeout_s else None
        try:
            replies = self._wait(refs, method, list(range(self.world_size)), timeout_s)
        except KeelError as error:
            self.ended = self.ended or error
            raise self.ended from None
        self.last_memory.update(enumerate(reply.memory for reply in replies))
        return Replies(replies)

    def shutdown(self) -> None:
        """Kill the workers and free their devices; after a failure it has already run."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.channel is not None:
            self.channel.shutdown()
            self.channel = None
        if self.actors:
            for actor in self.actors:
                ray.kill(actor)
            remove_placement_group(self.placement)
            self.actors = []

    # --- failures ------------------------------------------------------------------------------
    def _wait(self, refs: list, phase: str, ranks: list[int], timeout_s: float | None) -> list:
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
                        f"rank {rank}'s collective timed out after trainer.collective_timeout_s ({first_line})",
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
        """A rank whose collective lost its peer: if one of the ranks still pending died, that death is
        the run's error (the lost connection only follows from it). Waits PEER_DEATH_WAIT_S at most."""
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

    def _where(self, rank: int, phase: str) -> str:
        host = self.hosts.get(rank, "?")
        return f"rank {rank} of {self.world_size} (host {host}, role {self.role}, phase {phase})"

    def _raised(self, rank: int, phase: str, error) -> KeelError:
        self.shutdown()
        cause = getattr(error, "cause", None)
        # the worker's own diagnosis keeps its code
        if isinstance(cause, KeelError):
            return KeelError(cause.code, f"{self._where(rank, phase)}: {cause.message}", cause.fix)
        remote = str(error).strip()
        return KeelError(
            WORKER_RAISED,
            f"{self._where(rank, phase)} raised "
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
            f"{self._where(rank, phase)} died without raising: killed by the "
            f"system (e.g. out of memory) or crashed in native code. Last memory reading: "
            f"{reading}. Ray said: {str(error).splitlines()[0] if str(error) else type(error).__name__}",
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
                f"===== {self._where(r, s['phase'])} =====\n{s['text']}" for r, s in stacks.items()
            )
        )
        absent = [r for r in waiting if not stacks[r]["in_collective"]]
        self.shutdown()
        return KeelError(
            PHASE_STALLED,
            f"{why}. Ranks that did not arrive: {absent or 'none identified'}; "
            f"still running: {waiting}; every rank's stacks: {path}",
        )


def _done(call, *args) -> Future:
    future: Future = Future()
    try:
        future.set_result(call(*args))
    except BaseException as error:  # noqa: BLE001 - raised by result(), as by the call itself
        future.set_exception(error)
    return future


def _is_collective_timeout(error) -> bool:
    """A collective that gave up waiting (gloo's or NCCL's timeout), judged by the exception's
    own message: the traceback always mentions torch.distributed and timeouts."""
    message = str(getattr(error, "cause", None) or "").lower()
    return "timed out" in message or "timeout" in message


def _is_peer_lost(error) -> bool:
    """A collective whose peer went away (gloo's reset or closed connection, NCCL's remote error)."""
    message = str(getattr(error, "cause", None) or "").lower()
    return any(text in message for text in PEER_LOST)


def _worker_actor_class(ray):
    @ray.remote(concurrency_groups={"control": 1})
    class WorkerActor:
        """A served worker in its own process; `stacks` answers on a second thread, so the driver
        can see where a rank is stuck while its main thread is blocked."""

        def hostname(self) -> str:
            import socket

            return socket.gethostname()

        def rendezvous(self, port: int | None) -> tuple[str, int]:
            from keel.distributed.dist import rendezvous_port

            return ray.util.get_node_ip_address(), rendezvous_port(port)

        def setup(self, build, rank: int, world_size: int, master, split_cores: bool) -> None:
            import torch

            from keel.observe.log import ensure_console_logging

            ensure_console_logging()
            if split_cores:
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
            self.served = ServedWorker(build(rank=rank, world_size=world_size, master=master), rank)

        def run(self, method, *args):
            return self.served.run(method, *args)

        def describe(self):
            return self.served.describe()

        @ray.method(concurrency_group="control")
        def stacks(self) -> dict:
            served = getattr(self, "served", None)
            if served is None:
                return {"phase": "setup", "in_collective": False, "text": "(still setting up)"}
            return served.stacks()

    return WorkerActor
