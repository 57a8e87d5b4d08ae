"""The native engine's one copy of the weights: fused QKV and gate-up projections in the compute
dtype, filled by name from the policy's parameters (a module's own, or whole parameters gathered
from FSDP shards a bucket at a time), laid out as the model's family (models/) names them.

Under LoRA the trainer's frozen base is this same memory (`alias`: its parameters become views of
the fused buffers) and the adapters are applied unmerged in the step (`load_adapters`), so one copy
of the base is on the device and a sync moves only the adapters."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
from torch import Tensor

from keel.rollout.native.models import Family, LayerWeights
from keel.rollout.native.models.base import ADAPTED, LowRank

__all__ = ["DecodeWeights", "LayerWeights"]

# kept in the residual stream's dtype, not the compute dtype
STREAM_BUFFERS = ("embed", "norm")


class DecodeWeights:
    """The decode weight buffers, where each policy parameter goes in them, and what is read once
    from the model that training never changes (the RoPE frequencies). It never keeps the policy
    module, so a sharded actor needs no whole float32 copy per rank for generation."""

    def __init__(self, model, family: Family, device: torch.device, dtype: torch.dtype):
        sources = _decode_weight_sources(model, family)
        names = {id(p): name for name, p in model.named_parameters()}
        # The residual stream's dtype is the trainer's: float32 master weights under autocast keep
        # it, the embeddings it starts from and the norms' weights in float32, rounding only a
        # matmul's inputs; a LoRA base in the compute dtype keeps it there. The embeddings rounded
        # to bf16 were most of the sampler/trainer log-prob gap (0.0072 -> 0.0026 on CPU).
        self.stream_dtype = torch.promote_types(dtype, model.get_input_embeddings().weight.dtype)
        b = self.buffers = {
            name: torch.empty(
                _fused_shape(parts),
                device=device,
                dtype=self.stream_dtype if name.endswith(STREAM_BUFFERS) else dtype,
            )
            for name, parts in sources.items()
        }
        # parameter -> (buffer, first row, shape)
        self.targets: dict[str, tuple[str, int, torch.Size]] = {}
        for buffer, parts in sources.items():
            rows = itertools.accumulate((p.shape[0] for p in parts), initial=0)
            self.targets.update(
                {names[id(p)]: (buffer, row, p.shape) for p, row in zip(parts, rows)}
            )
        self.layers = [
            LayerWeights.from_buffers(b, i) for i in range(len(model.get_decoder().layers))
        ]
        self.embed, self.final_norm = b["embed"], b["final_norm"]
        # Tied embeddings: one buffer, or where the embeddings are float32 the head's own copy in
        # the compute dtype, refreshed from them on every load (its matmul rounds its inputs).
        self.lm_head = b.get(
            "lm_head", self.embed if self.embed.dtype == dtype else self.embed.to(dtype)
        )
        self.rotary = {
            kind: (inv_freq.detach().to(device, torch.float32), scale)
            for kind, (inv_freq, scale) in family.rotary_frequencies(model).items()
        }

    def norm_after(self, layer: int) -> Tensor:
        """The norm applied to layer `layer`'s output: the next layer's input norm (None where
        layers have none), or the final one."""
        return (
            self.layers[layer + 1].input_norm if layer + 1 < len(self.layers) else self.final_norm
        )

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
            # a part-filled buffer would mix old weights with new
            if tensor.shape != shape:
                raise RuntimeError(
                    f"native rollout: {name} has shape {tuple(tensor.shape)}, not {tuple(shape)}"
                )
            self.buffers[buffer][row : row + shape[0]].copy_(tensor.detach())
            if (
                buffer == "embed"
                and self.lm_head is not self.embed
                and "lm_head" not in self.buffers
            ):
                self.lm_head.copy_(tensor.detach())
            missing.discard(name)
        # a caller bug, not a user's: the engine would generate from stale weights
        if missing:
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
            view = self.buffers[buffer][row : row + shape[0]]
            if param.shape != shape or param.dtype != view.dtype or param.device != view.device:
                # another dtype or device: it keeps its own memory
                continue
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
            a, b = _fused_low_rank(
                sorted(parts, key=lambda part: part[0]), self.buffers[buffer].shape[0]
            )
            field = ADAPTED[kind]
            current = getattr(self.layers[int(layer)], field)
            if current is not None and current[0].shape == a.shape and current[1].shape == b.shape:
                current[0].copy_(a)
                current[1].copy_(b)
            else:
                setattr(
                    self.layers[int(layer)],
                    field,
                    (
                        a.to(self.embed.device, self.embed.dtype),
                        b.to(self.embed.device, self.embed.dtype),
                    ),
                )


def _decode_weight_sources(model, family: Family) -> dict[str, list[Tensor]]:
    """Each decode weight as the module tensors it is made of, stacked by rows (fused QKV and
    gate-up projections): the embedding, final norm and output head, and each layer's as its family
    names them."""
    decoder = model.get_decoder()
    sources = {"embed": [decoder.embed_tokens.weight], "final_norm": [decoder.norm.weight]}
    if model.get_output_embeddings().weight is not decoder.embed_tokens.weight:
        sources["lm_head"] = [model.get_output_embeddings().weight]
    for i, layer in enumerate(decoder.layers):
        sources.update(
            {f"{i}.{name}": parts for name, parts in family.hf_weight_map(layer).items()}
        )
    return sources


def _fused_low_rank(parts: list[tuple[int, Tensor, Tensor]], rows: int) -> LowRank:
    """(A stacked, B block-diagonal) of a fused projection from its parts' (first row, A, B)."""
    a = torch.cat([part_a for _, part_a, _ in parts])
    b = a.new_zeros(rows, a.shape[0], dtype=parts[0][2].dtype)
    rank_at = 0
    for row, part_a, part_b in parts:
        b[row : row + part_b.shape[0], rank_at : rank_at + part_a.shape[0]] = part_b
        rank_at += part_a.shape[0]
    return a, b


def _fused_shape(parts: list[Tensor]) -> torch.Size:
    return torch.Size([sum(p.shape[0] for p in parts), *parts[0].shape[1:]])
