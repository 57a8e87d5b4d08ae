"""Phi-3: Llama's layer (RMSNorm, rotary embeddings, grouped-query attention, a gated SiLU MLP)
under other module names. Its attention's q, k and v are one projection (`qkv_proj`, stacked by
rows in that order) and its MLP's gate and up are one (`gate_up_proj`, gate first): the layouts of
the engine's own fused buffers, so each fills its buffer whole. A `sliding_window` in its config
(Phi-3-mini-4k's 2047) narrows every layer's attention, as transformers' mask does."""

from __future__ import annotations

from torch import Tensor

from keel.models.families import PHI3
from keel.rollout.native.models.llama import LlamaFamily


class Phi3Family(LlamaFamily):
    facts = PHI3

    @classmethod
    def unsupported_reason(cls, config) -> str | None:
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
        rope = rope or {}
        partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        if partial not in (None, 1.0):
            return f"partial_rotary_factor {partial} (native rotates whole heads)"
        if rope.get("rope_type", rope.get("type")) == "longrope":
            # transformers picks the short or long factors by the longest sequence of each forward
            # pass, so one sequence's rotation depends on its batch, which a cache kept across
            # steps cannot follow
            return (
                "longrope rotary embeddings (Phi-3 128k, Phi-3.5): transformers switches their "
                "frequencies with each batch's longest sequence"
            )
        return super().unsupported_reason(config)

    def hf_weight_map(self, layer) -> dict[str, list[Tensor]]:
        attn, mlp = layer.self_attn, layer.mlp
        return {
            "qkv": [attn.qkv_proj.weight],
            "o": [attn.o_proj.weight],
            "gate_up": [mlp.gate_up_proj.weight],
            "down": [mlp.down_proj.weight],
            "input_norm": [layer.input_layernorm.weight],
            "post_norm": [layer.post_attention_layernorm.weight],
        }

    def window(self, layer: int) -> int | None:
        return getattr(self.config, "sliding_window", None)
