"""The native engine's one copy of the weights: fused QKV and gate-up projections in the compute
dtype, filled by name from the policy's parameters (a module's own, or whole parameters gathered
from FSDP shards a bucket at a time), and which architectures it can run."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

SUPPORTED_ARCHS = {"qwen2", "llama", "mistral"}
STATIC_ROPE = {"default", "linear", "llama3"}  # inv_freq does not depend on the sequence length


def unsupported_reason(config) -> str | None:
    """Why the native engine cannot run a model of this (Hugging Face) config, or None when it can."""
    if config.model_type not in SUPPORTED_ARCHS:
        return f"model_type {config.model_type!r} (native supports {sorted(SUPPORTED_ARCHS)})"
    rope = (getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if rope.get("rope_type", rope.get("type", "default")) not in STATIC_ROPE:
        return f"rope type {rope.get('rope_type')!r} (native supports {sorted(STATIC_ROPE)})"
    mistral_window = config.model_type == "mistral" and getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", False) or mistral_window:
        return "sliding-window attention"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    output_bias = config.model_type != "qwen2" and getattr(config, "attention_bias", False)  # Qwen2: q, k, v only
    if getattr(config, "mlp_bias", False) or output_bias:
        return "biases on the MLP or the attention output (the fused decode step has none)"
    return None



@dataclass
class LayerWeights:
    input_norm: Tensor
    qkv: Tensor            # [(H + 2 KV) * D, hidden]
    qkv_bias: Tensor | None
    o: Tensor
    post_norm: Tensor
    gate_up: Tensor        # [2 * intermediate, hidden]
    down: Tensor



class DecodeWeights:
    """The decode weight buffers, where each policy parameter goes in them, and what is read once
    from the model that training never changes (the RoPE frequencies). It never keeps the policy
    module, so a sharded actor needs no whole float32 copy per rank for generation."""

    def __init__(self, model, device: torch.device, dtype: torch.dtype):
        sources = _decode_weight_sources(model)
        names = {id(p): name for name, p in model.named_parameters()}
        b = self.buffers = {name: torch.empty(_fused_shape(parts), device=device, dtype=dtype)
                            for name, parts in sources.items()}
        self.targets: dict[str, tuple[str, int, torch.Size]] = {}  # parameter -> (buffer, first row, shape)
        for buffer, parts in sources.items():
            rows = itertools.accumulate((p.shape[0] for p in parts), initial=0)
            self.targets.update({names[id(p)]: (buffer, row, p.shape) for p, row in zip(parts, rows)})
        self.layers = [LayerWeights(input_norm=b[f"{i}.input_norm"], qkv=b[f"{i}.qkv"], qkv_bias=b.get(f"{i}.qkv_bias"),
                                    o=b[f"{i}.o"], post_norm=b[f"{i}.post_norm"], gate_up=b[f"{i}.gate_up"],
                                    down=b[f"{i}.down"])
                       for i in range(len(model.get_decoder().layers))]
        self.embed, self.final_norm = b["embed"], b["final_norm"]
        self.lm_head = b.get("lm_head", self.embed)  # tied embeddings: one buffer
        rotary = model.get_decoder().rotary_emb
        self.inv_freq = rotary.inv_freq.detach().to(device, torch.float32)
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))

    def norm_after(self, layer: int) -> Tensor:
        """The norm applied to layer `layer`'s output: the next layer's input norm, or the final one."""
        return self.layers[layer + 1].input_norm if layer + 1 < len(self.layers) else self.final_norm

    @torch.no_grad()
    def load(self, named: Iterable[tuple[str, Tensor]], every: bool = True) -> None:
        """Fill the buffers in place, cast to the compute dtype, from (parameter name, whole tensor)
        pairs: every parameter the engine uses (or, `every=False`, those that changed: LoRA's
        adapted layers), in any order. In place, so CUDA graphs kept between calls
        (free_cache_engine=False) read the new weights."""
        missing = set(self.targets) if every else set()
        for name, tensor in named:
            if name not in self.targets:
                continue
            buffer, row, shape = self.targets[name]
            if tensor.shape != shape:  # a part-filled buffer would mix old weights with new
                raise RuntimeError(f"native rollout: {name} has shape {tuple(tensor.shape)}, not {tuple(shape)}")
            self.buffers[buffer][row:row + shape[0]].copy_(tensor.detach())
            missing.discard(name)
        if missing:  # a caller bug, not a user's: the engine would generate from stale weights
            raise RuntimeError(f"native rollout: no weights given for {sorted(missing)[:3]}")



def _decode_weight_sources(model) -> dict[str, list[Tensor]]:
    """Each decode weight as the module tensors it is made of, stacked by rows (fused QKV and
    gate-up projections)."""
    decoder = model.get_decoder()
    sources = {"embed": [decoder.embed_tokens.weight], "final_norm": [decoder.norm.weight]}
    if model.get_output_embeddings().weight is not decoder.embed_tokens.weight:
        sources["lm_head"] = [model.get_output_embeddings().weight]
    for i, layer in enumerate(decoder.layers):
        attn, mlp = layer.self_attn, layer.mlp
        sources.update({f"{i}.input_norm": [layer.input_layernorm.weight],
                        f"{i}.qkv": [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
                        f"{i}.o": [attn.o_proj.weight], f"{i}.post_norm": [layer.post_attention_layernorm.weight],
                        f"{i}.gate_up": [mlp.gate_proj.weight, mlp.up_proj.weight], f"{i}.down": [mlp.down_proj.weight]})
        if attn.q_proj.bias is not None:
            sources[f"{i}.qkv_bias"] = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
    return sources



def _fused_shape(parts: list[Tensor]) -> torch.Size:
    return torch.Size([sum(p.shape[0] for p in parts), *parts[0].shape[1:]])
