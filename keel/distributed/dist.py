"""torch.distributed for one worker: set-up (rank, world, backend, timeout) and the bucketed
collectives keel runs itself (gradient averaging without FSDP, gathering whole parameters)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from keel.errors import MASTER_PORT_UNUSABLE, KeelError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def port_from_environment() -> int | None:
    """MASTER_PORT, as torchrun users set it (a firewall that opens one port, say): keel's rank 0
    listens there instead of on a port it picks. Not a port number is an error, never ignored."""
    raw = os.environ.get("MASTER_PORT")
    if raw is None or raw == "":
        return None
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise KeelError(
            MASTER_PORT_UNUSABLE,
            f"MASTER_PORT={raw!r} is not a port number",
            f"run `export MASTER_PORT={free_port()}` (a port free here now), or `unset "
            "MASTER_PORT` to let keel choose one",
        )
    return int(raw)


def rendezvous_port(wanted: int | None) -> int:
    """The port rank 0 listens on: MASTER_PORT when given (it must be free here), else a free
    one."""
    if wanted is None:
        return free_port()
    with socket.socket() as s:
        # as torch's store binds: TIME_WAIT is free
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", wanted))
        except OSError as e:
            raise KeelError(
                MASTER_PORT_UNUSABLE,
                f"MASTER_PORT={wanted} is taken on rank 0's node ({e.strerror})",
                f"run `export MASTER_PORT={free_port()}` (a port free here now), or `unset "
                "MASTER_PORT` to let keel choose one",
            ) from None
    return wanted


def init_process_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device: torch.device,
    timeout_s: float,
) -> None:
    """NCCL for GPU tensors, gloo for CPU ones (CPU-offloaded parameters and gradients need it).
    The timeout bounds every collective: a rank that never arrives makes the others fail after
    `timeout_s` instead of NCCL's default of ten minutes."""
    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK="0",
    )
    kwargs = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(
        "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )


def memory_reading(device: torch.device) -> dict[str, float]:
    """This process's resident memory, and the GPU's allocated and peak memory, in GB."""
    reading = {"rss_gb": _rss_bytes() / 1e9}
    if device.type == "cuda":
        reading["gpu_allocated_gb"] = torch.cuda.memory_allocated(device) / 1e9
        reading["gpu_peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return reading


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    # not Linux
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# per collective: few calls, bounded extra memory
BUCKET_BYTES = 256 << 20


def byte_buckets(
    items: list, nbytes: Callable, limit: int = BUCKET_BYTES, key: Callable = lambda item: None
) -> Iterator[list]:
    """Consecutive items in buckets of at most `limit` bytes (a larger item alone), and a new bucket
    wherever `key` changes (dtype, process group): one collective per bucket, not per tensor,
    since with a few hundred parameters the per-call cost dominates."""
    bucket, size = [], 0
    for item in items:
        if bucket and (size + nbytes(item) > limit or key(item) != key(bucket[0])):
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += nbytes(item)
    if bucket:
        yield bucket


def average_gradients(params: list[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> None:
    """Data parallelism without sharding (DDP): every rank's gradients replaced by their mean over
    the ranks, one all-reduce per bucket."""
    world = dist.get_world_size()
    for bucket in byte_buckets(
        [p.grad for p in params], lambda g: g.nbytes, bucket_bytes, key=lambda g: g.dtype
    ):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        # a sum: gloo has no average
        dist.all_reduce(flat)
        flat.div_(world)
        for grad, reduced in zip(bucket, flat.split([g.numel() for g in bucket])):
            grad.copy_(reduced.view_as(grad))
