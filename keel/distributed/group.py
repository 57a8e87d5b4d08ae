"""Worker groups: the driver's handle on its workers, in this process or as Ray actors.

`call(method, per_rank_args, ...)` runs `method` on every rank with that rank's arguments and
returns the results in rank order. A failure anywhere becomes a KeelError that names the rank,
host, role and phase: a worker's exception (with its traceback), a worker the system killed
(with its last memory reading), or a phase that stalled (with every rank's stacks on disk and
the ranks that never reached the collective named).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from keel.distributed.dist import port_from_environment
from keel.errors import (NOT_ENOUGH_DEVICES, PHASE_STALLED, RAY_MISSING, WORKER_DIED, WORKER_RAISED,
                         KeelError)

log = logging.getLogger("keel")

ROLE = "actor_rollout_ref"  # the colocated roles every worker of the group runs
STACKS_TIMEOUT_S = 15.0
STARTUP_TIMEOUT_S = 600.0


class LocalGroup:
    """One worker in the driver's process: the single-device case, with no Ray and no copies."""

    world_size = 1

    def __init__(self, worker):
        self.worker = worker
        self.memory: dict[int, dict] = {}  # rank -> its reading after the last call

    def call(self, method: str, per_rank_args: list[tuple]) -> list:
        result, self.memory[0] = self.worker.run(method, *per_rank_args[0])
        return [result]

    def shutdown(self) -> None:
        pass


class RayGroup:
    """`world_size` Ray actors, one per GPU (or CPU process with trainer.device=cpu), each a
    torch.distributed rank. Ranks are placed with a PACK placement group, so ranks of a node are
    consecutive; rank 0's node hosts the rendezvous on a port it found free."""

    def __init__(self, cfg, total_steps: int, actor_weights: str | None, stacks_dir: Path,
                 roles: frozenset[str] | None = None, world_size: int | None = None):
        """`roles`: what each worker builds (PolicyWorker's default: the policy, and the critic when
        colocated); a critic pool is a second group with roles {"critic"} and its own size."""
        ray = connect_ray(cfg)
        self.world_size = world_size or cfg.world_size
        self.role = ",".join(sorted(roles)) if roles else ROLE
        self.stacks_dir = stacks_dir
        self.phase_timeout_s = cfg.trainer.guards.phase_timeout_s
        self.memory: dict[int, dict] = {}
        self.hosts: dict[int, str] = {}
        self.placement, cpus = _reserve(ray, cfg, self.world_size)
        actor_class = _worker_actor_class(ray)
        gpus = 1 if wants_gpus(cfg) else 0
        env = {k: v for k, v in os.environ.items() if k.startswith("KEEL_")}  # a cluster's workers lack our env
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.actors = [actor_class.options(
            num_cpus=cpus, num_gpus=gpus, runtime_env={"env_vars": env} if env else None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=rank),
        ).remote() for rank in range(self.world_size)]
        ranks = list(range(self.world_size))
        self.hosts = dict(zip(ranks, self._wait([a.hostname.remote() for a in self.actors], "setup", ranks,
                                                STARTUP_TIMEOUT_S)))
        # MASTER_PORT is the policy group's; a critic pool's rank 0 picks a port of its own.
        port = port_from_environment() if roles is None else None
        master = self._wait([self.actors[0].rendezvous.remote(port)], "setup", [0], STARTUP_TIMEOUT_S)[0]
        log.info("%s ranks meet at %s:%d%s", self.role, *master, " (MASTER_PORT)" if port else "")
        self._wait([a.setup.remote(cfg, total_steps, actor_weights, rank, self.world_size, master, roles)
                    for rank, a in enumerate(self.actors)], "setup", ranks, STARTUP_TIMEOUT_S)
        for info in self.call("info", [()] * self.world_size):  # what each rank holds of each model
            log.info("rank %d on %s (pid %d, %s, CUDA_VISIBLE_DEVICES=%s, %d threads)%s", info["rank"],
                     self.hosts[info["rank"]], info["pid"], info["device"], info["visible"], info["threads"],
                     "".join(f", {k}={v:.3f}" for k, v in info.items() if k.startswith("fsdp/")))

    def call(self, method: str, per_rank_args: list[tuple]) -> list:
        refs = [a.run.remote(method, *args) for a, args in zip(self.actors, per_rank_args)]
        results = self._wait(refs, method, list(range(self.world_size)), self.phase_timeout_s)
        for rank, (_, memory) in enumerate(results):
            self.memory[rank] = memory
        return [result for result, _ in results]

    def shutdown(self) -> None:
        """Kill the workers and free their devices; after a failure it has already run."""
        import ray
        from ray.util.placement_group import remove_placement_group

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
                raise self._stalled(phase, sorted(pending.values()), f"phase {phase!r} ran past "
                                    f"trainer.guards.phase_timeout_s={timeout_s}")
            rank = pending.pop(ready[0])
            try:
                results[rank] = ray.get(ready[0])
            except RayTaskError as e:
                if _is_collective_timeout(e):
                    first_line = str(e.cause).strip().splitlines()[0][:300]
                    raise self._stalled(phase, sorted(pending.values()), f"rank {rank}'s collective timed out "
                                        f"after trainer.collective_timeout_s ({first_line})") from None
                raise self._raised(rank, phase, e) from None
            except RayError as e:  # the actor died, was killed by Ray's memory monitor, or lost its node
                raise self._died(rank, phase, e) from None
        return [results[r] for r in ranks]

    def _where(self, rank: int, phase: str) -> str:
        host = self.hosts.get(rank, "?")
        return f"rank {rank} of {self.world_size} (host {host}, role {self.role}, phase {phase})"

    def _raised(self, rank: int, phase: str, error) -> KeelError:
        self.shutdown()
        cause = getattr(error, "cause", None)
        if isinstance(cause, KeelError):  # the worker's own diagnosis keeps its code
            return KeelError(cause.code, f"{self._where(rank, phase)}: {cause.message}", cause.fix)
        remote = str(error).strip()
        return KeelError(WORKER_RAISED, f"{self._where(rank, phase)} raised "
                         f"{type(cause).__name__ if cause else 'an exception'}: {cause}\n"
                         f"--- worker traceback ---\n{remote}")

    def _died(self, rank: int, phase: str, error) -> KeelError:
        self.shutdown()
        memory = self.memory.get(rank)
        reading = (", ".join(f"{k}={v:.2f}" for k, v in memory.items()) if memory
                   else "none (it died before its first call returned)")
        return KeelError(WORKER_DIED, f"{self._where(rank, phase)} died without raising: killed by the "
                         f"system (e.g. out of memory) or crashed in native code. Last memory reading: "
                         f"{reading}. Ray said: {str(error).splitlines()[0] if str(error) else type(error).__name__}")

    def _stalled(self, phase: str, waiting: list[int], why: str) -> KeelError:
        """Every rank's stacks to disk; ranks whose main thread is not inside torch.distributed
        are the ones that did not arrive."""
        import ray

        stacks = {}
        for rank, actor in enumerate(self.actors):
            try:
                stacks[rank] = ray.get(actor.stacks.remote(), timeout=STACKS_TIMEOUT_S)
            except Exception as e:  # a dead or wedged process cannot answer: say so in the dump
                stacks[rank] = {"phase": "?", "in_collective": False, "text": f"(no stacks: {e})"}
        self.stacks_dir.mkdir(parents=True, exist_ok=True)
        path = self.stacks_dir / f"stacks_{phase}_{int(time.time())}.txt"
        path.write_text("\n\n".join(f"===== {self._where(r, s['phase'])} =====\n{s['text']}"
                                    for r, s in stacks.items()))
        absent = [r for r in waiting if not stacks[r]["in_collective"]]
        self.shutdown()
        return KeelError(PHASE_STALLED, f"{why}. Ranks that did not arrive: {absent or 'none identified'}; "
                         f"still running: {waiting}; every rank's stacks: {path}")


def _is_collective_timeout(error) -> bool:
    """A collective that gave up waiting (gloo's or NCCL's timeout), judged by the exception's
    own message: the traceback always mentions torch.distributed and timeouts."""
    message = str(getattr(error, "cause", None) or "").lower()
    return "timed out" in message or "timeout" in message


def wants_gpus(cfg) -> bool:
    """Like resolve_device, without refusing `cuda` when the driver's node has no GPU: on a
    cluster the workers' nodes may have them."""
    import torch
    return cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())


def devices_needed(cfg) -> int:
    """GPUs (CPU processes with trainer.device=cpu) the run places: the policy's workers, and the
    critic's workers and the reward model's replicas when they have pools of their own."""
    return cfg.world_size + sum(cfg.pools.values())


def require_devices(ray, cfg) -> None:
    """Refuse up front a run whose workers and pools the cluster cannot hold, instead of waiting
    forever for them to be placed."""
    resource = "GPU" if wants_gpus(cfg) else "CPU"
    available = ray.cluster_resources().get(resource, 0)
    if available < devices_needed(cfg):
        needs = [f"trainer.n_gpus_per_node x trainer.nnodes = {cfg.world_size} workers need {cfg.world_size} "
                 f"{resource}s"] + [f"the {role} pool needs {count} {resource}s" for role, count in cfg.pools.items()]
        raise KeelError(NOT_ENOUGH_DEVICES, "; ".join(needs) + f"; the Ray cluster has {available:g}")


def connect_ray(cfg):
    """Join the cluster in RAY_ADDRESS, or start a local instance sized for this machine."""
    try:
        import ray
    except ImportError:
        raise KeelError(RAY_MISSING, f"trainer.n_gpus_per_node x trainer.nnodes = {cfg.world_size} workers "
                        "need Ray, which is not installed") from None
    if ray.is_initialized():
        return ray
    address = os.environ.get("RAY_ADDRESS")
    try:
        if address:
            require_reachable(address)
            ray.init(address=address, log_to_driver=True)
        else:
            _start_or_join_local(ray, cfg)
    except KeelError:
        raise
    except Exception as e:  # noqa: BLE001 - any start/connect failure has one fix
        auth = ("; the address answers, so if the cluster uses Ray's token authentication (on by default "
                "for clusters Ray starts itself since 2.59), set RAY_AUTH_MODE=token here too, with the "
                "nodes' token (RAY_AUTH_TOKEN, or the same ~/.ray/auth_token)") if address else ""
        raise KeelError(RAY_MISSING, f"could not {'join the Ray cluster at ' + address if address else 'start Ray'}: "
                        f"{e}{auth}") from None
    return ray


def _start_or_join_local(ray, cfg) -> None:
    """A Ray instance of keel's own, sized for this machine; or, when `ray start` runs a cluster on
    this machine (the head node of the multi-node recipe, RAY_ADDRESS forgotten), that cluster,
    which Ray joins unasked and which refuses sizes given by a joining driver."""
    try:
        ray.init(num_cpus=max(os.cpu_count() or 1, devices_needed(cfg)), include_dashboard=False,
                 object_store_memory=512 * 1024**2, log_to_driver=True)
    except ValueError as e:
        if "existing cluster" not in str(e):
            raise
        log.info("joining the Ray cluster that `ray start` runs on this machine (RAY_ADDRESS is not set)")
        ray.init(log_to_driver=True)


def require_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Something must answer at RAY_ADDRESS's host and port: ray.init would otherwise retry for
    minutes before saying why. `auto` and `local` name no port and are left to Ray."""
    import socket

    where = address.removeprefix("ray://")
    if where in ("auto", "local") or ":" not in where:
        return
    host, port = where.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):  # [::1]:6379
            return
    except (OSError, ValueError) as e:
        raise KeelError(RAY_MISSING, f"nothing answers at RAY_ADDRESS={address} ({e})",
                        "start the head node (`ray start --head`) and set RAY_ADDRESS to its host:6379, "
                        "or unset RAY_ADDRESS to let keel start a local Ray instance") from None


def _reserve(ray, cfg, count: int):
    """One bundle per rank, packed onto as few nodes as possible, and the CPUs each worker gets;
    refused up front when the cluster does not have the devices the whole run places (every
    pool), instead of waiting forever."""
    from ray.util.placement_group import placement_group

    require_devices(ray, cfg)
    gpus = wants_gpus(cfg)
    resource = "GPU" if gpus else "CPU"
    # A GPU worker gets a share of the node's cores: Ray limits a worker's threads to its CPUs,
    # and one core is not enough for a process that launches kernels, gathers and copies.
    cpus = max(1, min(8, int(ray.cluster_resources().get("CPU", 1) // devices_needed(cfg)) - 1)) if gpus else 1
    bundle = {"GPU": 1, "CPU": cpus} if gpus else {"CPU": 1}
    group = placement_group([bundle] * count, strategy="PACK")
    if not group.wait(timeout_seconds=60):
        raise KeelError(NOT_ENOUGH_DEVICES, f"{count} {resource}s could not be reserved within 60 s "
                        "(other jobs hold them)")
    return group, cpus


def _worker_actor_class(ray):
    @ray.remote(concurrency_groups={"control": 1})
    class WorkerActor:
        """A PolicyWorker in its own process; `stacks` answers on a second thread, so the driver
        can see where a rank is stuck while its main thread is blocked."""

        def hostname(self) -> str:
            import socket
            return socket.gethostname()

        def rendezvous(self, port: int | None) -> tuple[str, int]:
            from keel.distributed.dist import rendezvous_port
            return ray.util.get_node_ip_address(), rendezvous_port(port)

        def setup(self, cfg, total_steps, actor_weights, rank, world_size, master, roles=None) -> None:
            import torch

            from keel.distributed.worker import PolicyWorker
            from keel.observe.log import ensure_console_logging

            ensure_console_logging()
            if not wants_gpus(cfg):  # CPU workers share the machine's cores
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
            self.worker = PolicyWorker(cfg, total_steps, actor_weights, rank, world_size, master, roles=roles)

        def run(self, method, *args):
            return self.worker.run(method, *args)

        @ray.method(concurrency_group="control")
        def stacks(self) -> dict:
            worker = getattr(self, "worker", None)
            if worker is None:
                return {"phase": "setup", "in_collective": False, "text": "(still setting up)"}
            return worker.stacks()

    return WorkerActor
