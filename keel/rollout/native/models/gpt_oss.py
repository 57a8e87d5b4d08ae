"""GPT-OSS: sliding-window (128) and global attention layers in turn, biases on every attention
projection, a learned attention sink per head (a logit in the softmax's normaliser that attends to
nothing: the attention kernels take it), YaRN rotary embeddings, RMSNorm that scales in float32
before the cast, and in every layer a mixture of experts: a router with a bias picks the top k
experts by logit and softmaxes those k, each expert a clamped SwiGLU (gate and up interleaved,
`(up + 1) * gate * sigmoid(alpha * gate)`) with biases.

The experts run as grouped matmuls over the (token, expert) pairs sorted by expert, as Qwen3-MoE's
do: no host synchronisation, so the step is captured in a CUDA graph."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from keel.models.families import GPT_OSS
from keel.rollout.native.layers import LowRank, attention_inputs, project, residual_add
from keel.rollout.native.models.base import Family, LayerWeights, hf_projection_map, layer_args

# the same RMSNorm: scaled, then cast
from keel.rollout.native.models.olmo2 import olmo_norm as gpt_oss_norm
from keel.rollout.native.models.qwen3_moe import expert_pairs, grouped_linear, grouped_mm_runs


def biased_grouped_linear(
    x: Tensor, weight: Tensor, bias: Tensor, offsets: Tensor, expert_of_row: Tensor, grouped: bool
) -> Tensor:
    """Qwen3-MoE's grouped_linear over GPT-OSS's experts, stored input-major ([E, in, out]: passed
    transposed, a view), plus each row's expert's bias [E, out]."""
    return grouped_linear(x, weight.mT, offsets, expert_of_row, grouped) + bias[expert_of_row]


def clamped_swiglu(gate_up: Tensor, alpha: float, limit: float) -> Tensor:
    """GPT-OSS's activation over its interleaved gate and up columns."""
    gate, up = gate_up[:, ::2].clamp(max=limit), gate_up[:, 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssExpertsArgs(NamedTuple):
    """What a GPT-OSS layer's after-attention function takes after x, the attention and the next
    norm: the output projection (its bias, its LoRA adapters, or None), the norm before the mixture,
    the router and the experts (each with its bias), then the family's constants (base.layer_args
    fills each field by its name)."""

    o: Tensor
    o_bias: Tensor | None
    o_lora: LowRank | None
    post_norm: Tensor
    router: Tensor  # [E, hidden]
    router_bias: Tensor  # [E]
    experts_gate_up: Tensor  # [E, hidden, 2 * intermediate], gate and up interleaved
    experts_gate_up_bias: Tensor  # [E, 2 * intermediate]
    experts_down: Tensor  # [E, intermediate, hidden]
    experts_down_bias: Tensor  # [E, hidden]
    top_k: int
    # the clamped SwiGLU's
    alpha: float
    limit: float
    # the experts run as torch's grouped matmul (qwen3_moe.grouped_mm_runs)
    grouped: bool
    eps: float


def gpt_oss_experts(h: Tensor, args: GptOssExpertsArgs) -> Tensor:
    """The mixture's output [N, hidden] for normed inputs h [N, hidden], as transformers computes
    it: the top k router logits softmaxed in the input dtype, each expert's output scaled and
    summed."""
    gate_up, grouped = args.experts_gate_up, args.grouped
    # a float32 stream's normed input, cast as autocast casts a matmul's
    h = h.to(gate_up.dtype)
    # [N, k]
    top_logits, experts = torch.topk(F.linear(h, args.router, args.router_bias), args.top_k, dim=-1)
    weights = torch.softmax(top_logits, dim=-1)
    token, order, offsets, expert_of_row = expert_pairs(experts, gate_up.shape[0])
    hidden = biased_grouped_linear(
        h[token], gate_up, args.experts_gate_up_bias, offsets, expert_of_row, grouped
    )
    hidden = clamped_swiglu(hidden, args.alpha, args.limit)
    out = biased_grouped_linear(
        hidden, args.experts_down, args.experts_down_bias, offsets, expert_of_row, grouped
    )  # [N k, hidden]
    out = out * weights.flatten()[order, None]
    return torch.zeros_like(h).index_add_(0, token, out)


def gpt_oss_attention_output_and_experts(
    x: Tensor, attention: Tensor, next_norm: Tensor, args: GptOssExpertsArgs
) -> tuple[Tensor, Tensor]:
    """The rest of a GPT-OSS layer: output projection and residual, the experts and residual, and
    the next layer's normed input."""
    x = residual_add(x, project(attention, args.o, args.o_lora, args.o_bias))
    x = residual_add(x, gpt_oss_experts(gpt_oss_norm(x, args.post_norm, args.eps), args))
    return x, gpt_oss_norm(x, next_norm, args.eps)


class GptOssFamily(Family):
    facts = GPT_OSS
    batch_invariant_blocker = "its attention sinks and mixture of experts"
    # Llama's: without q/k norms (the layer has none), with biases on q, k and v
    attention_inputs = staticmethod(attention_inputs)
    after_attention = {"experts": gpt_oss_attention_output_and_experts}
    norm = staticmethod(gpt_oss_norm)
    not_by_default = (
        "GPT-OSS by default: at GPT-OSS-20B's shapes (random weights, bf16, LoRA) its log-probs "
        "were 0.25 a token from the trainer's before any update (benchmarks/README.md); "
        "rollout.name=native runs it"
    )

    def __init__(self, config):
        super().__init__(config)
        self.top_k = config.num_experts_per_tok
        # transformers before 5.2x fixed alpha at 1.702 in the experts module, not in the config
        self.alpha = float(getattr(config, "swiglu_alpha", 1.702))
        self.limit = float(getattr(config, "swiglu_limit", 7.0))

    def hf_weight_map(self, layer) -> dict[str, list[Tensor]]:
        attn, mlp = layer.self_attn, layer.mlp
        sources = {
            **hf_projection_map(layer),
            "input_norm": [layer.input_layernorm.weight],
            "post_norm": [layer.post_attention_layernorm.weight],
            "sinks": [attn.sinks],
            "router": [mlp.router.weight],
            "router_bias": [mlp.router.bias],
            "experts_gate_up": [mlp.experts.gate_up_proj],
            "experts_gate_up_bias": [mlp.experts.gate_up_proj_bias],
            "experts_down": [mlp.experts.down_proj],
            "experts_down_bias": [mlp.experts.down_proj_bias],
        }
        if attn.o_proj.bias is not None:
            sources["o_bias"] = [attn.o_proj.bias]
        return sources

    def layer_kind(self, layer: LayerWeights) -> str:
        return "experts"

    def window(self, layer: int) -> int | None:
        return (
            self.config.sliding_window
            if self.config.layer_types[layer] == "sliding_attention"
            else None
        )

    def after_attention_args(self, layer: LayerWeights) -> tuple:
        experts = layer.experts_gate_up
        # every layer's experts share one device and dtype: one answer, cached
        self.grouped = grouped_mm_runs(experts.device.type, experts.dtype)
        return layer_args(GptOssExpertsArgs, layer, self)
