"""Llama-shaped decoders: Qwen2/2.5, Qwen3 (RMSNorm on each head's query and key), Llama 3.x,
Mistral and SmolLM3 (rotary embeddings left out of every fourth layer: `no_rope_layers`). RMSNorm,
rotary embeddings, grouped-query attention (biases on q, k, v for Qwen2) and a gated SiLU MLP."""

from __future__ import annotations

import torch
from torch import Tensor

from keel.rollout.native.layers import attention_inputs, attention_output_and_mlp
from keel.rollout.native.models.base import Family, LayerWeights


class LlamaFamily(Family):
    model_types = frozenset({"qwen2", "qwen3", "llama", "mistral", "smollm3"})
    attention_inputs = staticmethod(attention_inputs)
    after_attention = {"mlp": attention_output_and_mlp}

    @classmethod
    def unsupported_reason(cls, config) -> str | None:
        mistral_window = config.model_type == "mistral" and getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", False) or mistral_window:
            return "sliding-window attention"
        if getattr(config, "hidden_act", "silu") != "silu":
            return f"activation {config.hidden_act!r}"
        output_bias = config.model_type != "qwen2" and getattr(config, "attention_bias", False)  # Qwen2: q, k, v only
        if getattr(config, "mlp_bias", False) or output_bias:
            return "biases on the MLP or the attention output (the fused decode step has none)"
        return super().unsupported_reason(config)

    def layer_sources(self, layer) -> dict[str, list[Tensor]]:
        sources = self.attention_sources(layer)
        mlp = layer.mlp
        sources.update(gate_up=[mlp.gate_proj.weight, mlp.up_proj.weight], down=[mlp.down_proj.weight])
        return sources

    def rotary_frequencies(self, model) -> dict[str, tuple[Tensor, float]]:
        """Rotary frequencies, and for SmolLM3's NoPE layers none: frequency 0 rotates by nothing
        (cos 1, sin 0: q and k unchanged, exactly)."""
        rotary = super().rotary_frequencies(model)
        inv_freq, _ = rotary["default"]
        return {**rotary, "none": (torch.zeros_like(inv_freq), 1.0)} if self._no_rope else rotary

    @property
    def _no_rope(self) -> list[int]:
        return [i for i, uses in enumerate(getattr(self.config, "no_rope_layers", None) or []) if not uses]

    def rope_kind(self, layer: int) -> str:
        return "none" if layer in self._no_rope else "default"

    @staticmethod
    def attention_sources(layer) -> dict[str, list[Tensor]]:
        attn = layer.self_attn
        sources = {"input_norm": [layer.input_layernorm.weight], "post_norm": [layer.post_attention_layernorm.weight],
                   "qkv": [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], "o": [attn.o_proj.weight]}
        if attn.q_proj.bias is not None:
            sources["qkv_bias"] = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        if getattr(attn, "q_norm", None) is not None:
            sources.update(q_norm=[attn.q_norm.weight], k_norm=[attn.k_norm.weight])
        return sources

    def layer_kind(self, layer: LayerWeights) -> str:
        return "mlp"

    def attention_args(self, layer: LayerWeights) -> tuple:
        return layer.qkv, layer.qkv_bias, layer.qkv_lora, layer.q_norm, layer.k_norm, self.heads, self.kv_heads, self.eps

    def after_attention_args(self, layer: LayerWeights) -> tuple:
        return layer.o, layer.post_norm, layer.gate_up, layer.down, layer.adapters_after_attention, self.eps

