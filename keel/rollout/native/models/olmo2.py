"""OLMo 2: no norm before the attention or the MLP; instead RMSNorm on each one's output before
its residual add, and on the whole query and key projections (not per head). Its RMSNorm scales in
float32 before the cast. Otherwise Llama's: rotary embeddings, grouped-query attention, SiLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from keel.models.families import OLMO2
from keel.rollout.native.layers import AttentionArgs, MlpArgs, applyrope, project, residual_add
from keel.rollout.native.models.base import Family, hf_projection_map


def olmo_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """OLMo 2's RMSNorm: times the weight in float32, then cast (Llama casts first)."""
    return (weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps)).to(x.dtype)


def olmo_attention_inputs(
    h: Tensor, cos: Tensor, sin: Tensor, args: AttentionArgs
) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, H, 1, D], k and v [B, KV, 1, D]: the query and key projections normed whole, then
    rotated."""
    batch, head_dim, heads, kv_heads = h.shape[0], cos.shape[-1], args.heads, args.kv_heads
    qkv = project(h, args.qkv, args.qkv_lora)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q = olmo_norm(qkv[:, :q_size], args.q_norm, args.eps)
    k = olmo_norm(qkv[:, q_size : q_size + kv_size], args.k_norm, args.eps)
    qk = applyrope(torch.cat([q, k], dim=-1).view(batch, heads + kv_heads, head_dim), cos, sin).to(
        qkv.dtype
    )
    return (
        qk[:, :heads].unsqueeze(2),
        qk[:, heads:].unsqueeze(2),
        qkv[:, -kv_size:].view(batch, kv_heads, 1, head_dim),
    )


def olmo_attention_output_and_mlp(
    x: Tensor, attention: Tensor, next_norm: Tensor | None, args: MlpArgs
) -> tuple[Tensor, Tensor]:
    """The attention's output normed before its residual add, the MLP on the unnormed stream and
    its output normed; the next layer's input is the stream itself (the final norm after the
    last)."""
    eps = args.eps
    x = residual_add(x, olmo_norm(project(attention, args.o, args.o_lora), args.post_norm, eps))
    gate, up = project(x, args.gate_up, args.gate_up_lora).chunk(2, dim=-1)
    mlp = project(F.silu(gate) * up, args.down, args.down_lora)
    x = residual_add(x, olmo_norm(mlp, args.post_mlp_norm, eps))
    return x, (x if next_norm is None else olmo_norm(x, next_norm, eps))


class Olmo2Family(Family):
    facts = OLMO2
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

    def hf_weight_map(self, layer) -> dict[str, list[Tensor]]:
        return {
            **hf_projection_map(layer),
            "post_norm": [layer.post_attention_layernorm.weight],
            "post_mlp_norm": [layer.post_feedforward_layernorm.weight],
        }
