"""Llama-shaped decoders: Qwen2/2.5, Qwen3 (RMSNorm on each head's query and key), Llama 3.x,
Mistral and SmolLM3 (rotary embeddings left out of every fourth layer: `no_rope_layers`). RMSNorm,
rotary embeddings, grouped-query attention (biases on q, k, v for Qwen2) and a gated SiLU MLP."""

from __future__ import annotations

import torch
from torch import Tensor

from keel.models.families import LLAMA
from keel.rollout.native.layers import attention_inputs, attention_output_and_mlp
from keel.rollout.native.models.base import Family, hf_projection_map


class LlamaFamily(Family):
    facts = LLAMA
    attention_inputs = staticmethod(attention_inputs)
    after_attention = {"mlp": attention_output_and_mlp}

    def __init__(self, config):
        super().__init__(config)
        # SmolLM3: layers whose no_rope_layers entry is 0 have no rotary embedding
        self.no_rope = {
            i for i, uses in enumerate(getattr(config, "no_rope_layers", None) or []) if not uses
        }

    @classmethod
    def unsupported_reason(cls, config) -> str | None:
        mistral_window = config.model_type == "mistral" and getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", False) or mistral_window:
            return "sliding-window attention"
        if getattr(config, "hidden_act", "silu") != "silu":
            return f"activation {config.hidden_act!r}"
        # Qwen2: q, k, v only
        output_bias = config.model_type != "qwen2" and getattr(config, "attention_bias", False)
        if getattr(config, "mlp_bias", False) or output_bias:
            return "biases on the MLP or the attention output (the fused decode step has none)"
        return super().unsupported_reason(config)

    def hf_weight_map(self, layer) -> dict[str, list[Tensor]]:
        return {
            **hf_projection_map(layer),
            "input_norm": [layer.input_layernorm.weight],
            "post_norm": [layer.post_attention_layernorm.weight],
        }

    def rotary_frequencies(self, model) -> dict[str, tuple[Tensor, float]]:
        """Rotary frequencies, and for SmolLM3's NoPE layers none: frequency 0 rotates by nothing
        (cos 1, sin 0: q and k unchanged, exactly)."""
        rotary = super().rotary_frequencies(model)
        inv_freq, _ = rotary["default"]
        return {**rotary, "none": (torch.zeros_like(inv_freq), 1.0)} if self.no_rope else rotary

    def rope_kind(self, layer: int) -> str:
        return "none" if layer in self.no_rope else "default"
