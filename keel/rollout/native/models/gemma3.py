"""Gemma 3 (text): sliding-window and global attention layers in turn (each kind with its own RoPE
base), RMSNorm on each head's query and key, four norms a layer (before and after the attention
and the MLP), Gemma's RMSNorm (x times 1 + w, in float32), the embedding scaled by sqrt(hidden),
a GELU-tanh gated MLP, and queries scaled by query_pre_attn_scalar."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from keel.models.families import GEMMA3
from keel.rollout.native.layers import AttentionArgs, MlpArgs, applyrope, project, residual_add
from keel.rollout.native.models.base import STATIC_ROPE, Family, hf_projection_map


def gemma_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gemma's RMSNorm: scaled by 1 + w, all in float32, then cast (Llama casts before scaling)."""
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * (1.0 + weight.float())).to(x.dtype)


def gemma_attention_inputs(
    h: Tensor, cos: Tensor, sin: Tensor, args: AttentionArgs
) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, H, 1, D], k and v [B, KV, 1, D]: each head's query and key normed, then rotated; the
    query scaled so that the kernels' 1/sqrt(D) makes query_pre_attn_scalar's scale."""
    batch, head_dim, heads, eps = h.shape[0], cos.shape[-1], args.heads, args.eps
    qkv = project(h, args.qkv, args.qkv_lora)
    kv_size = args.kv_heads * head_dim
    qk = qkv[:, :-kv_size].view(batch, heads + args.kv_heads, head_dim)
    qk = torch.cat(
        [gemma_norm(qk[:, :heads], args.q_norm, eps), gemma_norm(qk[:, heads:], args.k_norm, eps)],
        dim=1,
    )
    qk = applyrope(qk, cos, sin)
    q = qk[:, :heads] if args.query_scale == 1.0 else qk[:, :heads] * args.query_scale
    # rotated in the stream's dtype: rounded once
    q, k = q.to(qkv.dtype), qk[:, heads:].to(qkv.dtype)
    return q.unsqueeze(2), k.unsqueeze(2), qkv[:, -kv_size:].view(batch, args.kv_heads, 1, head_dim)


def gemma_attention_output_and_mlp(
    x: Tensor, attention: Tensor, next_norm: Tensor, args: MlpArgs
) -> tuple[Tensor, Tensor]:
    """The rest of a Gemma 3 layer: the attention's output normed before its residual add, the MLP
    between its two norms, and the next layer's normed input."""
    eps = args.eps
    x = residual_add(x, gemma_norm(project(attention, args.o, args.o_lora), args.post_norm, eps))
    normed = gemma_norm(x, args.pre_mlp_norm, eps)
    gate, up = project(normed, args.gate_up, args.gate_up_lora).chunk(2, dim=-1)
    mlp = project(F.gelu(gate, approximate="tanh") * up, args.down, args.down_lora)
    x = residual_add(x, gemma_norm(mlp, args.post_mlp_norm, eps))
    return x, gemma_norm(x, next_norm, eps)


class Gemma3Family(Family):
    facts = GEMMA3
    attention_inputs = staticmethod(gemma_attention_inputs)
    after_attention = {"mlp": gemma_attention_output_and_mlp}
    norm = staticmethod(gemma_norm)
    batch_invariant_blocker = "its sliding-window layers and GELU activation"

    def __init__(self, config):
        super().__init__(config)
        self.embed_scale = config.hidden_size**0.5
        self.query_scale = config.query_pre_attn_scalar**-0.5 / self.head_dim**-0.5

    @classmethod
    def unsupported_reason(cls, config) -> str | None:
        if getattr(config, "final_logit_softcapping", None) or getattr(
            config, "attn_logit_softcapping", None
        ):
            return "soft-capped logits"
        if getattr(config, "use_bidirectional_attention", False):
            return "bidirectional attention"
        if getattr(config, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            return f"activation {config.hidden_activation!r}"
        if getattr(config, "attention_bias", False):
            return "biases on the attention's projections"
        kinds = (getattr(config, "rope_parameters", None) or {}).values()
        rope_types = {(kind or {}).get("rope_type", "default") for kind in kinds}
        if not rope_types <= STATIC_ROPE:
            return f"rope types {sorted(rope_types)} (native supports {sorted(STATIC_ROPE)})"
        return None

    def rotary_frequencies(self, model) -> dict[str, tuple[Tensor, float]]:
        rotary = model.get_decoder().rotary_emb
        return {
            kind: (
                getattr(rotary, f"{kind}_inv_freq"),
                float(getattr(rotary, f"{kind}_attention_scaling", 1.0)),
            )
            for kind in set(self.config.layer_types)
        }

    def rope_kind(self, layer: int) -> str:
        return self.config.layer_types[layer]

    def window(self, layer: int) -> int | None:
        return (
            self.config.sliding_window
            if self.config.layer_types[layer] == "sliding_attention"
            else None
        )

    def hf_weight_map(self, layer) -> dict[str, list[Tensor]]:
        return {
            **hf_projection_map(layer),
            "input_norm": [layer.input_layernorm.weight],
            "post_norm": [layer.post_attention_layernorm.weight],
            "pre_mlp_norm": [layer.pre_feedforward_layernorm.weight],
            "post_mlp_norm": [layer.post_feedforward_layernorm.weight],
        }
