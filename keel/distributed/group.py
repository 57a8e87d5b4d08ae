"""Worker groups: the driver's handle on its workers, in this process or as Ray actors.

`call(method, per_rank_args)` runs `method` on every rank with that rank's arguments and returns the
results in rank order, with each rank's time and memory reading; `submit` starts the same call and
returns a future of it, so the driver may go on (a group's ranks take their calls in the order
submitted). A failure anywhere becomes a KeelError that names the rank, host, role and phase
(keel.distributed.rank_watch).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from pathlib import Path

from keel.distributed.finished import FinishedChannel
from keel.distributed.rank_watch import RankWatch
from keel.distributed.ray_cluster import Devices, connect_ray, reserve
from keel.distributed.serving import ServedWorker
from keel.errors import KeelError

log = logging.getLogger("keel")

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
        """The worker's helper processes (an agent rollout's) stop with the run, not with this
        process."""
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
        # what shut the group down: every later call raises it
        self.ended: KeelError | None = None
        # submitted calls not yet answered: a later call waits for them too
        self.in_flight: set[Future] = set()
        # samples told as they finish (generate's on_finished)
        self.channel: FinishedChannel | None = None
        self.placement, cpus = reserve(ray, devices, world_size)
        self.actors = _start_actors(ray, self.placement, devices, cpus, world_size)
        self.watch = RankWatch(world_size, role, stacks_dir, self.actors, self.shutdown)
        self._set_up(build, devices, rendezvous, port)

    def _set_up(self, build, devices: Devices, rendezvous: bool, port: int | None) -> None:
        """Each rank's host, the rendezvous, then each rank builds its worker and says where it
        runs."""
        ranks = list(range(self.world_size))

        def wait(refs: list, waited: list[int] = ranks) -> list:
            return self.watch.wait(refs, "setup", waited, STARTUP_TIMEOUT_S)

        self.watch.hosts.update(zip(ranks, wait([a.hostname.remote() for a in self.actors])))
        master = None
        if rendezvous:
            master = wait([self.actors[0].rendezvous.remote(port)], [0])[0]
            log.info(
                "%s ranks meet at %s:%d%s", self.role, *master, " (MASTER_PORT)" if port else ""
            )
        # CPU ranks share their node's cores
        split_cores = rendezvous and not devices.gpus
        wait(
            [
                a.setup.remote(build, rank, self.world_size, master, split_cores)
                for rank, a in enumerate(self.actors)
            ]
        )
        described = wait([a.describe.remote() for a in self.actors])
        # what a rank held before its first call
        self.watch.last_memory.update(enumerate(reply.memory for reply in described))
        self._log_ranks([reply.result for reply in described])

    def _log_ranks(self, described: list[dict]) -> None:
        """Where each rank runs, as it describes itself once set up."""
        for info in described:
            log.info(
                "%s rank %d on %s (pid %d, %s, CUDA_VISIBLE_DEVICES=%s, %d threads)%s",
                self.role,
                info["rank"],
                self.watch.hosts[info["rank"]],
                info["pid"],
                info["device"],
                info["visible"],
                info["threads"],
                "".join(f", {k}={v:.3f}" for k, v in info.items() if k.startswith("fsdp/")),
            )

    def call(self, method: str, per_rank_args: list[tuple]) -> Replies:
        return self._replies(method, self._send(method, per_rank_args), len(self.in_flight))

    def call_all(self, method: str, args: tuple) -> Replies:
        """The same arguments on every rank, stored once in Ray's object store (a whole model's
        weights)."""
        import ray

        # each rank's call reads them; none is copied per rank
        stored = tuple(ray.put(arg) for arg in args)
        return self.call(method, [stored] * self.world_size)

    def submit(self, method: str, per_rank_args: list[tuple]) -> Future:
        """The call sent to every rank now; the future holds its Replies, or the KeelError `call`
        raises."""
        refs, ahead = self._send(method, per_rank_args), len(self.in_flight)
        future: Future = Future()
        # set.add and set.discard are atomic: no lock with the waiting thread
        self.in_flight.add(future)

        def wait() -> None:
            try:
                future.set_result(self._replies(method, refs, ahead))
            # the caller of result() gets it, as call's did
            except BaseException as error:  # noqa: BLE001
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
            replies = self.watch.wait(refs, method, list(range(self.world_size)), timeout_s)
        except KeelError as error:
            self.ended = self.ended or error
            raise self.ended from None
        self.watch.last_memory.update(enumerate(reply.memory for reply in replies))
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
            # the watch's list too: a stall after this finds no rank to ask for its stacks
            self.actors.clear()


def _done(call, *args) -> Future:
    future: Future = Future()
    try:
        future.set_result(call(*args))
    except BaseException as error:  # noqa: BLE001 - raised by result(), as by the call itself
        future.set_exception(error)
    return future


def _start_actors(ray, placement, devices: Devices, cpus: float, world_size: int) -> list:
    """One Ray actor per rank, each in its own bundle of the placement group."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # a cluster's workers lack our env
    env = {k: v for k, v in os.environ.items() if k.startswith("KEEL_")}
    actor_class = _worker_actor_class(ray)
    return [
        actor_class.options(
            # a rank runs its calls in the order sent (versions rely on it)
            allow_out_of_order_execution=False,
            num_cpus=cpus,
            num_gpus=1 if devices.gpus else 0,
            runtime_env={"env_vars": env} if env else None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement, placement_group_bundle_index=rank
            ),
        ).remote()
        for rank in range(world_size)
    ]


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
