"""FSDP2 sharding of a Hugging Face model: every decoder layer, then the root.

Sharding the root last puts the embeddings, the final norm and `lm_head` in its group, so they
are sharded too, and tied embeddings stay one parameter. Weights stay float32 (the master copy);
with a bf16 compute dtype, gathered layers are bf16 and gradients are reduced in float32.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator

import torch
from torch import nn

from keel.distributed.dist import BUCKET_BYTES, byte_buckets

log = logging.getLogger("keel")

# A parameter this large left unsharded costs every rank its full size.
REPLICATED_WARN_NUMEL = 1_000_000


def block_modules(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (decoder layers) of a Hugging Face model, found by the class names it
    lists in `_no_split_modules`, so any architecture transformers supports is covered."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def compile_blocks(model: nn.Module) -> None:
    """torch.compile each decoder layer's forward (the same graph for every layer): its norms,
    RoPE, gate and residual adds, which run in float32 as separate kernels in eager mode, fuse
    around the matmuls. Only `forward` is replaced, so FSDP's hooks, state-dict names and
    checkpoints are unchanged."""
    # The actor's, the reference's and the critic's layers share one compiled code object, and
    # grad/no-grad, train/eval and the first variable-length call each take one of its entries:
    # past dynamo's default of 8 it would silently run the rest eagerly.
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 32))
    for block in block_modules(model):
        block.forward = torch.compile(block.forward)


def make_mesh(device_type: str, world_size: int, fsdp_size: int):
    """1-D mesh (shard over every rank), or 2-D (replicate, shard) when fsdp_size splits the world."""
    from torch.distributed.device_mesh import init_device_mesh

    if fsdp_size in (-1, world_size):
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (world_size // fsdp_size, fsdp_size),
                            mesh_dim_names=("replicate", "shard"))


def shard_model(model: nn.Module, mesh, compute_dtype: torch.dtype, fsdp_cfg) -> nn.Module:
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                        fully_shard, register_fsdp_forward_method)

    low_precision = compute_dtype != torch.float32
    options = dict(
        mesh=mesh, reshard_after_forward=fsdp_cfg.reshard_after_forward,
        mp_policy=MixedPrecisionPolicy(param_dtype=compute_dtype if low_precision else None,
                                       reduce_dtype=torch.float32),
        # Pinned host memory needs an accelerator; CPU workers (gloo) still take FSDP's offload path.
        offload_policy=(CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if fsdp_cfg.param_offload
                        else OffloadPolicy()))
    for block in block_modules(model):
        fully_shard(block, **options)
    fully_shard(model, **options)
    # keel's chunked log-prob path calls the decoder and lm_head itself; registering it as a
    # forward method makes FSDP gather the root's parameters (embeddings, lm_head) around it.
    from keel.training.forward import decoder_token_stats

    model.keel_token_stats = functools.partial(decoder_token_stats, model)
    register_fsdp_forward_method(model, "keel_token_stats")
    return model


def full_parameters(model: nn.Module, device: torch.device,
                    bucket_bytes: int = BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole parameter) for every parameter of an FSDP2-sharded model, exactly as stored.

    One collective gathers a bucket of parameters, in FSDP2's own layout: each rank holds rows
    [k*c, (k+1)*c) of a parameter, c = ceil(rows / ranks), so padded chunks laid side by side and
    cut to length give the whole."""
    named = list(model.named_parameters())
    for name, param in named:
        if _shard_group(param) is None:  # replicated, or a layout this does not cover
            yield name, param.detach().to(device).full_tensor() if hasattr(param, "full_tensor") else param.detach()
    sharded = [(name, param) for name, param in named if _shard_group(param) is not None]
    for bucket in byte_buckets(sharded, lambda item: item[1].numel() * item[1].element_size(), bucket_bytes,
                               key=lambda item: (item[1].dtype, _shard_group(item[1]))):
        yield from _gather_bucket(bucket, device)


def _shard_group(param):
    """(mesh, mesh dim) along which a DTensor parameter is sharded on dim 0, replicated on any
    other mesh dim (FSDP2 and HSDP); None for anything else."""
    from torch.distributed.tensor import Replicate, Shard

    placements = getattr(param, "placements", None)
    if placements is None or param.dim() == 0:
        return None
    sharded = [i for i, p in enumerate(placements) if p == Shard(0)]
    if len(sharded) != 1 or any(p != Replicate() for i, p in enumerate(placements) if i != sharded[0]):
        return None
    return param.device_mesh, sharded[0]


def _gather_bucket(bucket: list[tuple[str, torch.Tensor]], device: torch.device):
    import torch.distributed as dist

    mesh, mesh_dim = _shard_group(bucket[0][1])
    ranks = mesh.size(mesh_dim)
    slots = [-(-p.shape[0] // ranks) * p[0].numel() for _, p in bucket]  # padded chunk, flattened
    local = torch.zeros(sum(slots), dtype=bucket[0][1].dtype, device=device)
    offset = 0
    for (_, param), slot in zip(bucket, slots):
        shard = param.to_local().detach().reshape(-1)
        local[offset:offset + shard.numel()].copy_(shard)
        offset += slot
    gathered = torch.empty(ranks * local.numel(), dtype=local.dtype, device=device)  # flat: gloo wants 1-D
    dist.all_gather_into_tensor(gathered, local, group=mesh.get_group(mesh_dim))
    gathered = gathered.view(ranks, -1)
    offset = 0
    for (name, param), slot in zip(bucket, slots):
        chunks = gathered[:, offset:offset + slot].reshape(-1, *param.shape[1:])
        yield name, chunks[:param.shape[0]]
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
        log.warning("%s: %d large parameters are not sharded and every rank holds them whole, e.g. %s",
                    role, len(large), large[:3])
    return {f"fsdp/{role}_sharded_gb": sharded / 1e9, f"fsdp/{role}_replicated_gb": replicated / 1e9}
