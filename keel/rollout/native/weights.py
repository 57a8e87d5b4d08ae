"""The native engine's one copy of the weights: fused QKV and gate-up projections in the compute
dtype, filled by name from the policy's parameters (a module's own, or whole parameters gathered
from FSDP shards a bucket at a time), and which architectures it can run.

Under LoRA the trainer's frozen base is this same memory (`alias`: its parameters become views of
the fused buffers) and the adapters are applied unmerged in the step (`load_adapters`), so one copy
of the base is on the device and a sync moves only the adapters."""

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



LowRank = tuple[Tensor, Tensor]  # LoRA's (A [r, in], B [out, r] times its scaling) of one projection

ADAPTED = {"qkv": "qkv_lora", "o": "o_lora", "gate_up": "gate_up_lora", "down": "down_lora"}


@dataclass
class LayerWeights:
    input_norm: Tensor
    qkv: Tensor            # [(H + 2 KV) * D, hidden]
    qkv_bias: Tensor | None
    o: Tensor
    post_norm: Tensor
    gate_up: Tensor        # [2 * intermediate, hidden]
    down: Tensor
    # LoRA, unmerged. A fused projection's adapters are one: its parts' A stacked by rows, their B
    # block-diagonal, so a fused matmul stays one matmul (plus two thin ones).
    qkv_lora: LowRank | None = None
    o_lora: LowRank | None = None
    gate_up_lora: LowRank | None = None
    down_lora: LowRank | None = None

    @property
    def adapters_after_attention(self) -> tuple[LowRank | None, LowRank | None, LowRank | None]:
        return self.o_lora, self.gate_up_lora, self.down_lora



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

    def alias(self, named: Iterable[tuple[str, Tensor]]) -> int:
        """Point each given parameter (Hugging Face name, frozen, in the compute dtype) at its rows
        of the decode buffers, after they were filled from it: the trainer's frozen base and the
        engine's weights become one copy. -> bytes freed."""
        freed = 0
        for name, param in named:
            target = self.targets.get(name)
            if target is None:
                continue
            buffer, row, shape = target
            view = self.buffers[buffer][row:row + shape[0]]
            if param.shape != shape or param.dtype != view.dtype or param.device != view.device:
                continue  # another dtype or device: it keeps its own memory
            freed += param.nbytes
            param.data = view
        return freed

    @torch.no_grad()
    def load_adapters(self, adapters: Iterable[tuple[str, Tensor, Tensor]]) -> None:
        """LoRA's adapters, (weight name, A, B times scaling), into the layers, applied unmerged in
        the step. In place after the first call, so kept CUDA graphs read the new ones."""
        by_buffer: dict[str, list[tuple[int, Tensor, Tensor]]] = {}
        for name, a, b in adapters:
            buffer, row, _ = self.targets[name]
            by_buffer.setdefault(buffer, []).append((row, a, b))
        for buffer, parts in by_buffer.items():
            layer, kind = buffer.split(".")
            a, b = _fused_low_rank(sorted(parts, key=lambda part: part[0]), self.buffers[buffer].shape[0])
            field = ADAPTED[kind]
            current = getattr(self.layers[int(layer)], field)
            if current is not None and current[0].shape == a.shape and current[1].shape == b.shape:
                current[0].copy_(a)
                current[1].copy_(b)
            else:
                setattr(self.layers[int(layer)], field, (a.to(self.embed.device, self.embed.dtype),
                                                         b.to(self.embed.device, self.embed.dtype)))



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



def _fused_low_rank(parts: list[tuple[int, Tensor, Tensor]], rows: int) -> LowRank:
    """(A stacked, B block-diagonal) of a fused projection from its parts' (first row, A, B)."""
    a = torch.cat([part_a for _, part_a, _ in parts])
    b = a.new_zeros(rows, a.shape[0], dtype=parts[0][2].dtype)
    rank_at = 0
    for row, part_a, part_b in parts:
        b[row:row + part_b.shape[0], rank_at:rank_at + part_a.shape[0]] = part_b
        rank_at += part_a.shape[0]
    return a, b



def _fused_shape(parts: list[Tensor]) -> torch.Size:
    return torch.Size([sum(p.shape[0] for p in parts), *parts[0].shape[1:]])
