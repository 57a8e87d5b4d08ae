"""A model made ready to train on this rank: compiled, then sharded (anchor: torchtitan's
models/llama3/infra/parallelize.py). The trainer gets the model and its Placement, and reads
nothing else off the module.

FSDP2 shards every decoder layer, then the root: sharding the root last puts the embeddings, the
final norm and `lm_head` in its group, so they are sharded too, and tied embeddings stay one
parameter. Weights stay float32 (the master copy); with a bf16 compute dtype, gathered layers are
bf16 and gradients are reduced in float32.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from keel.distributed.dist import average_gradients
from keel.distributed.fsdp import sharding_report
from keel.training.forward import decoder_token_stats
from keel.training.placement import Placement


def parallelize(
    model: nn.Module,
    *,
    role: str,
    device: torch.device,
    world_size: int,
    compute_dtype: torch.dtype,
    fsdp_cfg,
    compile_layers: bool,
    fused_vocab: bool,
) -> tuple[nn.Module, Placement, dict[str, float]]:
    """(the model, its Placement, what this rank holds of it). In this order:
    1. compile each decoder layer, before FSDP wraps it, so its hooks stay outside the graph;
    2. with several ranks: leave the model whole (fsdp_size=1, gradients averaged by keel's
       bucketed all-reduce), or shard each layer and then the root;
    3. route the chunked log-prob path through FSDP, so the root's parameters are gathered for it.
    """
    if compile_layers:
        compile_blocks(model)
    sharded = world_size > 1 and fsdp_cfg.fsdp_size != 1
    # Adam's moments in CPU memory on a GPU; with FSDP's param_offload the update runs on CPU
    # anyway.
    offload = (
        fsdp_cfg.optimizer_offload
        and device.type == "cuda"
        and not (sharded and fsdp_cfg.param_offload)
    )
    if world_size == 1:
        return model, Placement(fused_vocab=fused_vocab, optimizer_offload=offload), {}
    if not sharded:
        return (
            model,
            Placement(
                fused_vocab=fused_vocab,
                data_parallel_size=world_size,
                reduce_gradients=average_gradients,
                optimizer_offload=offload,
            ),
            {},
        )
    model = shard_model(
        model, make_mesh(device.type, world_size, fsdp_cfg.fsdp_size), compute_dtype, fsdp_cfg
    )
    placement = Placement(
        device=device,
        fused_vocab=fused_vocab,
        token_stats=sharded_token_stats(model, fused_vocab),
        data_parallel_size=world_size,
        optimizer_offload=offload,
    )
    return model, placement, sharding_report(model, role)


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
        if not _holds_float32_experts(block):
            block.forward = torch.compile(block.forward)


def _holds_float32_experts(block: nn.Module) -> bool:
    """A mixture's stacked experts ([E, out, in]) not in bfloat16: under torch.compile transformers
    cannot run them as grouped matmuls (compiled, those take bfloat16 only) and loops over the
    experts one by one; eagerly the grouped matmul runs in float32."""
    return any(p.dim() == 3 and p.dtype != torch.bfloat16 for p in block.parameters())


def make_mesh(device_type: str, world_size: int, fsdp_size: int):
    """1-D mesh (shard over every rank), or 2-D (replicate, shard) when fsdp_size splits the
    world."""
    from torch.distributed.device_mesh import init_device_mesh

    if fsdp_size in (-1, world_size):
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(
        device_type, (world_size // fsdp_size, fsdp_size), mesh_dim_names=("replicate", "shard")
    )


def shard_model(model: nn.Module, mesh, compute_dtype: torch.dtype, fsdp_cfg) -> nn.Module:
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    low_precision = compute_dtype != torch.float32
    options = dict(
        mesh=mesh,
        reshard_after_forward=fsdp_cfg.reshard_after_forward,
        mp_policy=MixedPrecisionPolicy(
            param_dtype=compute_dtype if low_precision else None, reduce_dtype=torch.float32
        ),
        # Pinned host memory needs an accelerator; CPU workers (gloo) still take FSDP's offload
        # path.
        offload_policy=(
            CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
            if fsdp_cfg.param_offload
            else OffloadPolicy()
        ),
    )
    for block in block_modules(model):
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def sharded_token_stats(model: nn.Module, fused_vocab: bool):
    """keel's chunked log-prob path calls the decoder and lm_head itself, outside the root's
    forward; registered as a forward method, it makes FSDP gather the root's parameters
    (embeddings, lm_head) around it. FSDP hooks a method of the module, hence the attribute."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    model.keel_token_stats = functools.partial(decoder_token_stats, model, fused_vocab=fused_vocab)
    register_fsdp_forward_method(model, "keel_token_stats")
    return model.keel_token_stats
