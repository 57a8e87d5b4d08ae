"""What a rank reads back from an FSDP2-sharded model: whole parameters gathered a bucket at a
time (for the rollout engine), and how much of the model it holds."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import nn

from keel.distributed.dist import BUCKET_BYTES, byte_buckets

log = logging.getLogger("keel")

# A parameter this large left unsharded costs every rank its full size.
REPLICATED_WARN_NUMEL = 1_000_000


def full_parameters(
    model: nn.Module, device: torch.device, bucket_bytes: int = BUCKET_BYTES
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole parameter) for every parameter of an FSDP2-sharded model, exactly as stored.

    One collective gathers a bucket of parameters, in FSDP2's own layout: each rank holds rows
    [k*c, (k+1)*c) of a parameter, c = ceil(rows / ranks), so padded chunks laid side by side and
    cut to length give the whole."""
    named = list(model.named_parameters())
    for name, param in named:
        # replicated, or a layout this does not cover
        if _shard_group(param) is None:
            yield (
                name,
                param.detach().to(device).full_tensor()
                if hasattr(param, "full_tensor")
                else param.detach(),
            )
    sharded = [(name, param) for name, param in named if _shard_group(param) is not None]
    for bucket in byte_buckets(
        sharded,
        lambda item: item[1].numel() * item[1].element_size(),
        bucket_bytes,
        key=lambda item: (item[1].dtype, _shard_group(item[1])),
    ):
        yield from _gather_bucket(bucket, device)


def _shard_group(param):
    """(mesh, mesh dim) along which a DTensor parameter is sharded on dim 0, replicated on any
    other mesh dim (FSDP2 and HSDP); None for anything else."""
    from torch.distributed.tensor import Replicate, Shard

    placements = getattr(param, "placements", None)
    if placements is None or param.dim() == 0:
        return None
    sharded = [i for i, p in enumerate(placements) if p == Shard(0)]
    if len(sharded) != 1 or any(
        p != Replicate() for i, p in enumerate(placements) if i != sharded[0]
    ):
        return None
    return param.device_mesh, sharded[0]


def _gather_bucket(bucket: list[tuple[str, torch.Tensor]], device: torch.device):
    import torch.distributed as dist

    mesh, mesh_dim = _shard_group(bucket[0][1])
    ranks = mesh.size(mesh_dim)
    # padded chunk, flattened
    slots = [-(-p.shape[0] // ranks) * p[0].numel() for _, p in bucket]
    local = torch.zeros(sum(slots), dtype=bucket[0][1].dtype, device=device)
    offset = 0
    for (_, param), slot in zip(bucket, slots):
        shard = param.to_local().detach().reshape(-1)
        local[offset : offset + shard.numel()].copy_(shard)
        offset += slot
    # flat: gloo wants 1-D
    gathered = torch.empty(ranks * local.numel(), dtype=local.dtype, device=device)
    dist.all_gather_into_tensor(gathered, local, group=mesh.get_group(mesh_dim))
    gathered = gathered.view(ranks, -1)
    offset = 0
    for (name, param), slot in zip(bucket, slots):
        chunks = gathered[:, offset : offset + slot].reshape(-1, *param.shape[1:])
        yield name, chunks[: param.shape[0]]
        offset += slot


def sharding_report(model: nn.Module, role: str) -> dict[str, float]:
    """Bytes this rank holds of the model's parameters, sharded and not; warns about large
    parameters left replicated (every rank pays their full size)."""
    sharded = replicated = 0
    large: list[str] = []
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        size = local.numel() * local.element_size()
        if hasattr(p, "to_local"):
            sharded += size
        else:
            replicated += size
            if p.numel() >= REPLICATED_WARN_NUMEL:
                large.append(name)
    if large:
        log.warning(
            "%s: %d large parameters are not sharded and every rank holds them whole, e.g. %s",
            role,
            len(large),
            large[:3],
        )
    return {
        f"fsdp/{role}_sharded_gb": sharded / 1e9,
        f"fsdp/{role}_replicated_gb": replicated / 1e9,
    }
