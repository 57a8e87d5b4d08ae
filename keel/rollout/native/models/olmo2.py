"""OLMo 2: no norm before the attention or the MLP; instead RMSNorm on each one's output before
its residual add, and on the whole query and key projections (not per head). Its RMSNorm scales in
float32 before the cast. Otherwise Llama's: rotary embeddings, grouped-query attention, SiLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from keel.rollout.native.layers import applyrope, project, residual_add
from keel.rollout.native.models.base import Family, LayerWeights, projection_sources


def olmo_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """OLMo 2's RMSNorm: times the weight in float32, then cast (Llama casts first)."""
    return (weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps)).to(x.dtype)


def olmo_attention_inputs(
    h: Tensor,
    cos: Tensor,
    sin: Tensor,
    qkv_weight: Tensor,
    qkv_lora,
    q_norm: Tensor,
    k_norm: Tensor,
    heads: int,
    kv_heads: int,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, H, 1, D], k and v [B, KV, 1, D]: the query and key projections normed whole, then rotated."""
    batch, head_dim = h.shape[0], cos.shape[-1]
    qkv = project(h, qkv_weight, qkv_lora)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q = olmo_norm(qkv[:, :q_size], q_norm, eps)
    k = olmo_norm(qkv[:, q_size : q_size + kv_size], k_norm, eps)
    qk = applyrope(torch.cat([q, k], dim=-1).view(batch, heads + kv_heads, head_dim), cos, sin).to(
        qkv.dtype
    )
    return (
        qk[:, :heads].unsqueeze(2),
        qk[:, heads:].unsqueeze(2),
        qkv[:, -kv_size:].view(batch, kv_heads, 1, head_dim),
    )


def olmo_attention_output_and_mlp(
    x: Tensor,
    attention: Tensor,
    next_norm: Tensor | None,
    o: Tensor,
    post_norm: Tensor,
    gate_up: Tensor,
    down: Tensor,
    post_mlp_norm: Tensor,
    low_rank,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """The attention's output normed before its residual add, the MLP on the unnormed stream and
    its output normed; the next layer's input is the stream itself (the final norm after the last)."""
    o_lora, gate_up_lora, down_lora = low_rank
    x = residual_add(x, olmo_norm(project(attention, o, o_lora), post_norm, eps))
    gate, up = project(x, gate_up, gate_up_lora).chunk(2, dim=-1)
    x = residual_add(x, olmo_norm(project(F.silu(gate) * up, down, down_lora), post_mlp_norm, eps))
    return x, (x if next_norm is None else olmo_norm(x, next_norm, eps))


class Olmo2Family(Family):
    model_types = frozenset({"olmo2"})
    attention_inputs = staticmethod(olmo_attention_inputs)
    after_attention = {"mlp": olmo_attention_output_and_mlp}
    norm = staticmethod(olmo_norm)

    @classmethod
    def unsupported_reason(cls, config) -> str | None:
        if getattr(config, "hidden_act", "silu") != "silu":
            return f"activation {config.hidden_act!r}"
        if getattr(config, "attention_bias", False):
            return "biases on the attention's projections"
        return super().unsupported_reason(config)

    def layer_sources(self, layer) -> dict[str, list[Tensor]]:
        return {
            **projection_sources(layer),
            "post_norm": [layer.post_attention_layernorm.weight],
            "post_mlp_norm": [layer.post_feedforward_layernorm.weight],
        }

    def attention_args(self, layer: LayerWeights) -> tuple:
        return (
            layer.qkv,
            layer.qkv_lora,
            layer.q_norm,
            layer.k_norm,
            self.heads,
            self.kv_heads,
            self.eps,
        )

    def after_attention_args(self, layer: LayerWeights) -> tuple:
        return (
            layer.o,
            layer.post_norm,
            layer.gate_up,
            layer.down,
            layer.post_mlp_norm,
            layer.adapters_after_attention,
            self.eps,
        )
