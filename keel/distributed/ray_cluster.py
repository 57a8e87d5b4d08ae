"""The Ray cluster a run's worker groups live on: joined (RAY_ADDRESS) or started for this machine,
and asked up front for every device the run places (`Devices`), so a run it cannot hold is refused
with the numbers instead of waiting forever to be placed."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from keel.errors import NOT_ENOUGH_DEVICES, RAY_MISSING, KeelError

log = logging.getLogger("keel")


@dataclass(frozen=True)
class Devices:
    """What the whole run places on the cluster, so any group refuses one too small up front
    instead of waiting forever to be placed."""

    # GPUs, or CPU processes (trainer.device=cpu)
    gpus: bool
    # the policy's workers
    workers: int
    # role -> devices, for each role with a pool of its own
    pools: dict[str, int]

    @classmethod
    def of(cls, cfg) -> Devices:
        return cls(wants_gpus(cfg.trainer.device), cfg.world_size, dict(cfg.pools))

    @property
    def total(self) -> int:
        return self.workers + sum(self.pools.values())

    @property
    def resource(self) -> str:
        return "GPU" if self.gpus else "CPU"


def wants_gpus(device: str) -> bool:
    """Like resolve_device, without refusing `cuda` when the driver's node has no GPU: on a
    cluster the workers' nodes may have them."""
    import torch

    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def require_devices(ray, devices: Devices) -> None:
    """Refuse up front a run whose workers and pools the cluster cannot hold, instead of waiting
    forever for them to be placed."""
    resource = devices.resource
    available = ray.cluster_resources().get(resource, 0)
    if available < devices.total:
        needs = [
            f"trainer.n_gpus_per_node x trainer.nnodes = {devices.workers} workers need "
            f"{devices.workers} {resource}s"
        ] + [f"the {role} pool needs {count} {resource}s" for role, count in devices.pools.items()]
        raise KeelError(
            NOT_ENOUGH_DEVICES, "; ".join(needs) + f"; the Ray cluster has {available:g}"
        )


def connect_ray(devices: Devices):
    """Join the cluster in RAY_ADDRESS, or start a local instance sized for this machine."""
    try:
        import ray
    except ImportError:
        raise KeelError(
            RAY_MISSING,
            f"{devices.total} workers (trainer.n_gpus_per_node x trainer.nnodes, and "
            "any pools) need Ray, which is not installed",
        ) from None
    if ray.is_initialized():
        return ray
    address = os.environ.get("RAY_ADDRESS")
    try:
        if address:
            require_reachable(address)
            ray.init(address=address, log_to_driver=True)
        else:
            _start_or_join_local(ray, devices.total)
    except KeelError:
        raise
    except Exception as e:  # noqa: BLE001 - any start/connect failure has one fix
        auth = (
            (
                "; the address answers, so if the cluster uses Ray's token authentication (on by "
                "default for clusters Ray starts itself since 2.59), set RAY_AUTH_MODE=token here "
                "too, with the nodes' token (RAY_AUTH_TOKEN, or the same ~/.ray/auth_token)"
            )
            if address
            else ""
        )
        raise KeelError(
            RAY_MISSING,
            f"could not {'join the Ray cluster at ' + address if address else 'start Ray'}: "
            f"{e}{auth}",
        ) from None
    return ray


def _start_or_join_local(ray, devices_needed: int) -> None:
    """A Ray instance of keel's own, sized for this machine; or, when `ray start` runs a cluster on
    this machine (the head node of the multi-node recipe, RAY_ADDRESS forgotten), that cluster,
    which Ray joins unasked and which refuses sizes given by a joining driver."""
    try:
        ray.init(
            num_cpus=max(os.cpu_count() or 1, devices_needed),
            include_dashboard=False,
            object_store_memory=512 * 1024**2,
            log_to_driver=True,
        )
    except ValueError as e:
        if "existing cluster" not in str(e):
            raise
        log.info(
            "joining the Ray cluster that `ray start` runs on this machine (RAY_ADDRESS is not set)"
        )
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
        # [::1]:6379
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return
    except (OSError, ValueError) as e:
        raise KeelError(
            RAY_MISSING,
            f"nothing answers at RAY_ADDRESS={address} ({e})",
            "run `unset RAY_ADDRESS` to let keel start a Ray instance on this machine, or start "
            "the head node there (`ray start --head`) and set RAY_ADDRESS to its host:6379",
        ) from None


def reserve(ray, devices: Devices, count: int):
    """One bundle per rank, packed onto as few nodes as possible, and the CPUs each worker gets;
    refused up front when the cluster does not have the devices the whole run places (every
    pool), instead of waiting forever."""
    from ray.util.placement_group import placement_group

    require_devices(ray, devices)
    gpus, resource = devices.gpus, devices.resource
    # A GPU worker gets a share of the node's cores: Ray limits a worker's threads to its CPUs,
    # and one core is not enough for a process that launches kernels, gathers and copies.
    cpus = (
        max(1, min(8, int(ray.cluster_resources().get("CPU", 1) // devices.total) - 1))
        if gpus
        else 1
    )
    bundle = {"GPU": 1, "CPU": cpus} if gpus else {"CPU": 1}
    group = placement_group([bundle] * count, strategy="PACK")
    if not group.wait(timeout_seconds=60):
        raise KeelError(
            NOT_ENOUGH_DEVICES,
            f"{count} {resource}s could not be reserved within 60 s (other jobs hold them)",
        )
    return group, cpus
