"""Qwen3-MoE: Qwen3's attention, and in most layers a mixture of experts in place of the MLP (a
softmax router picks the top k of E gated SiLU experts per token; `mlp_only_layers` and
`decoder_sparse_step` keep some layers dense).

The experts run as two grouped matmuls over the (token, expert) pairs sorted by expert, with the
group offsets computed on the device: no host synchronisation, so the step is captured in a CUDA
graph like a dense one, and each expert's weights are read once per step whatever the batch."""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from keel.models.families import QWEN3_MOE
from keel.rollout.native.layers import (
    LowRank,
    attention_output_and_mlp,
    project,
    residual_add,
    rms_norm,
)
from keel.rollout.native.models.base import LayerWeights, layer_args
from keel.rollout.native.models.llama import LlamaFamily


@cache
def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether the experts run as torch's grouped matmul: in bfloat16 (what torch.compile's shape
    rules accept, and all CUDA's kernel takes), where it runs here, tried once on a small
    problem."""
    if dtype != torch.bfloat16:
        return False
    try:
        x = torch.ones(16, 16, device=device_type, dtype=dtype)
        torch._grouped_mm(
            x,
            torch.ones(2, 16, 16, device=device_type, dtype=dtype),
            offs=torch.tensor([8, 16], dtype=torch.int32, device=device_type),
        )
        return True
    except (RuntimeError, NotImplementedError):
        return False


def grouped_linear(
    x: Tensor, weight: Tensor, offsets: Tensor, expert_of_row: Tensor, grouped: bool
) -> Tensor:
    """Rows of x [M, in], sorted by expert, each times its expert's weight [E, out, in]^T. Where the
    grouped matmul does not run (float32: tests), every expert over every row, each row keeping its
    own expert's result: E times the work, still without a host sync."""
    if grouped:
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    out = x.new_zeros(x.shape[0], weight.shape[1])
    for expert in range(weight.shape[0]):
        out = torch.where((expert_of_row == expert)[:, None], F.linear(x, weight[expert]), out)
    return out


def expert_pairs(experts: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The (token, expert) pairs of a routing's chosen experts [N, k], sorted by expert: each pair's
    token, the sort order (to gather the pairs' routing weights), where each expert's pairs end
    (the grouped matmul's offsets) and each pair's expert. All on the device: no host sync."""
    pair_expert = experts.flatten()  # [N k]
    order = torch.argsort(pair_expert, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=experts.device)
    counts.scatter_add_(0, pair_expert.int(), torch.ones_like(pair_expert, dtype=torch.int32))
    return order // experts.shape[1], order, counts.cumsum(0, dtype=torch.int32), pair_expert[order]


def routed_experts(
    h: Tensor,
    router: Tensor,
    gate_up: Tensor,
    down: Tensor,
    top_k: int,
    normalize: bool,
    grouped: bool = True,
) -> Tensor:
    """The mixture's output [N, hidden] for normed inputs h [N, hidden], as transformers' Qwen3-MoE
    computes it: routing weights in float32 from the softmax over all experts, the top k
    renormalised (`norm_topk_prob`), each expert's output scaled in the input dtype and summed."""
    # a float32 stream's normed input, cast as autocast casts a matmul's
    h = h.to(gate_up.dtype)
    probs = F.softmax(F.linear(h, router).float(), dim=-1)  # [N, E]
    weights, experts = torch.topk(probs, top_k, dim=-1)  # [N, k]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(h.dtype)
    token, order, offsets, expert_of_row = expert_pairs(experts, gate_up.shape[0])
    gate, up = grouped_linear(h[token], gate_up, offsets, expert_of_row, grouped).chunk(2, dim=-1)
    out = grouped_linear(F.silu(gate) * up, down, offsets, expert_of_row, grouped)  # [N k, hidden]
    out = out * weights.flatten()[order, None]
    return torch.zeros_like(h).index_add_(0, token, out)


class ExpertsArgs(NamedTuple):
    """What a mixture layer's after-attention function takes after x, the attention and the next
    norm: the output projection (and its LoRA adapters, or None), the norm before the mixture,
    the router and the experts' weights, then the family's constants (base.layer_args fills each
    field by its name)."""

    o: Tensor
    o_lora: LowRank | None
    post_norm: Tensor
    router: Tensor  # [E, hidden]
    experts_gate_up: Tensor  # [E, 2 * intermediate, hidden]
    experts_down: Tensor  # [E, hidden, intermediate]
    top_k: int
    # renormalise the top k's routing weights (norm_topk_prob)
    normalize: bool
    # the experts run as torch's grouped matmul (grouped_mm_runs)
    grouped: bool
    eps: float


def attention_output_and_experts(
    x: Tensor, attention: Tensor, next_norm: Tensor, args: ExpertsArgs
) -> tuple[Tensor, Tensor]:
    """attention_output_and_mlp with the mixture of experts in place of the MLP (and, as it, the
    next layer's normed input in the projections' dtype)."""
    x = residual_add(x, project(attention, args.o, args.o_lora))
    experts = routed_experts(
        rms_norm(x, args.post_norm, args.eps),
        args.router,
        args.experts_gate_up,
        args.experts_down,
        args.top_k,
        args.normalize,
        args.grouped,
    )
    x = residual_add(x, experts)
    return x, rms_norm(x, next_norm, args.eps).to(args.o.dtype)


class Qwen3MoeFamily(LlamaFamily):
    facts = QWEN3_MOE
    batch_invariant_blocker = "its mixture of experts"
    after_attention = {"mlp": attention_output_and_mlp, "experts": attention_output_and_experts}

    def __init__(self, config):
        super().__init__(config)
        self.top_k, self.normalize = config.num_experts_per_tok, bool(config.norm_topk_prob)

    def hf_weight_map(self, layer) -> dict[str, list[Tensor]]:
        # a dense MLP's too: mlp_only_layers, or off decoder_sparse_step
        sources = super().hf_weight_map(layer)
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            sources.update(
                router=[mlp.gate.weight],
                experts_gate_up=[mlp.experts.gate_up_proj],
                experts_down=[mlp.experts.down_proj],
            )
        return sources

    def layer_kind(self, layer: LayerWeights) -> str:
        return "mlp" if layer.router is None else "experts"

    def after_attention_args(self, layer: LayerWeights) -> tuple:
        if layer.router is None:
            return super().after_attention_args(layer)
        experts = layer.experts_gate_up
        # every layer's experts share one device and dtype: one answer, cached
        self.grouped = grouped_mm_runs(experts.device.type, experts.dtype)
        return layer_args(ExpertsArgs, layer, self)
