"""FSDP2 sharding of a Hugging Face model: every decoder layer, then the root.

Sharding the root last puts the embeddings, the final norm and `lm_head` in its group, so they
are sharded too, and tied embeddings stay one parameter. Weights stay float32 (the master copy);
with a bf16 compute dtype, gathered layers are bf16 and gradients are reduced in float32.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

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
        offload_policy=CPUOffloadPolicy() if fsdp_cfg.param_offload else OffloadPolicy())
    for block in block_modules(model):
        fully_shard(block, **options)
    fully_shard(model, **options)
    # keel's chunked log-prob path calls the decoder and lm_head itself; registering it as a
    # forward method makes FSDP gather the root's parameters (embeddings, lm_head) around it.
    from keel.training.forward import decoder_token_stats

    model.keel_token_stats = functools.partial(decoder_token_stats, model)
    register_fsdp_forward_method(model, "keel_token_stats")
    return model


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
