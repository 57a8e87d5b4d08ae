"""What a family of decoders gives the native engine, and the weights of one decoder layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cache
from operator import attrgetter
from typing import TypeVar

from torch import Tensor

from keel.models.families import FamilyFacts
from keel.rollout.native.attention import Rotary
from keel.rollout.native.layers import AttentionArgs, LowRank, MlpArgs, rms_norm

# a step function's argument: a NamedTuple of the layer's tensors, then the family's constants
Args = TypeVar("Args", bound=tuple)
# inv_freq does not depend on the sequence length
STATIC_ROPE = {"default", "linear", "llama3", "yarn"}


@dataclass
class LayerWeights:
    """One decoder layer's decode buffers (a family fills the ones it has; the rest stay None)."""

    qkv: Tensor  # [(H + 2 KV) * D, hidden]
    o: Tensor
    # None: the layer's input is not normed (OLMo 2)
    input_norm: Tensor | None = None
    # after the attention: before the MLP, or on its output
    post_norm: Tensor | None = None
    qkv_bias: Tensor | None = None
    # GPT-OSS: biases on every attention projection
    o_bias: Tensor | None = None
    sinks: Tensor | None = None  # [H]: each head's attention sink logit (GPT-OSS)
    q_norm: Tensor | None = None  # [D]: RMSNorm of each head's query and key (Qwen3)
    k_norm: Tensor | None = None
    gate_up: Tensor | None = None  # [2 * intermediate, hidden]: a dense gated MLP
    down: Tensor | None = None
    # Gemma 3: norms before the MLP and after it
    pre_mlp_norm: Tensor | None = None
    post_mlp_norm: Tensor | None = None
    router: Tensor | None = None  # [E, hidden]: a mixture of experts instead
    experts_gate_up: Tensor | None = None  # [E, 2 * intermediate, hidden]
    experts_down: Tensor | None = None  # [E, hidden, intermediate]
    # GPT-OSS: [E]; its experts' weights [E, in, out] and biases [E, out]
    router_bias: Tensor | None = None
    experts_gate_up_bias: Tensor | None = None
    experts_down_bias: Tensor | None = None
    # LoRA, unmerged. A fused projection's adapters are one: its parts' A stacked by rows, their B
    # block-diagonal, so a fused matmul stays one matmul (plus two thin ones).
    qkv_lora: LowRank | None = None
    o_lora: LowRank | None = None
    gate_up_lora: LowRank | None = None
    down_lora: LowRank | None = None

    @classmethod
    def from_buffers(cls, buffers: dict[str, Tensor], layer: int) -> LayerWeights:
        return cls(
            **{
                f.name: buffers[f"{layer}.{f.name}"]
                for f in fields(cls)
                if f"{layer}.{f.name}" in buffers
            }
        )


def hf_projection_map(layer) -> dict[str, list[Tensor]]:
    """The weight map of a Hugging Face layer's attention projections (fused q, k, v; their biases
    and q/k norms where it has them) and, where its MLP is a dense gated one, of its projections
    (fused gate and up): the part of a family's `hf_weight_map` that most families share."""
    attn, mlp = layer.self_attn, layer.mlp
    sources = {
        "qkv": [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
        "o": [attn.o_proj.weight],
    }
    if attn.q_proj.bias is not None:
        sources["qkv_bias"] = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
    if getattr(attn, "q_norm", None) is not None:
        sources.update(q_norm=[attn.q_norm.weight], k_norm=[attn.k_norm.weight])
    if hasattr(mlp, "gate_proj"):
        sources.update(
            gate_up=[mlp.gate_proj.weight, mlp.up_proj.weight], down=[mlp.down_proj.weight]
        )
    return sources


ADAPTED = {"qkv": "qkv_lora", "o": "o_lora", "gate_up": "gate_up_lora", "down": "down_lora"}


class Family(ABC):
    """A family of decoders the engine runs: its facts record (models/families.py: model types and
    what the trainer and benchmark know of it), its HF weight map (each decode buffer as the module
    tensors it is made of, stacked by rows), and the layer's math as pure functions of plain
    tensors around the attention kernel, which the engine compiles once for every layer
    (torch.compile guards on shapes, not on which layer's tensors they are):

    - `attention_inputs(h, cos, sin, attention_args(layer))` -> q, k, v rotated, from the layer's
      normed input;
    - `after_attention[kind](x, attention, next_norm, after_attention_args(layer))` -> the residual
      stream and the next layer's normed input, for each kind of layer the family has
      (`layer_kind`);
    - `norm(x, weight, eps)`: its RMSNorm (the first layer's input norm is applied with it).

    Each step function takes the layer as one NamedTuple (layers.AttentionArgs, layers.MlpArgs, or
    a family's own) filled by name from the layer and the family (`layer_args`), which
    torch.compile reads as a tuple of tensors and constants. Where layers
    differ in their rotary frequencies or see a sliding window of the cache (Gemma 3),
    `rope_kind(i)` and `window(i)` say so."""

    facts: FamilyFacts
    attention_inputs: Callable
    after_attention: dict[str, Callable]
    norm: Callable = staticmethod(rms_norm)
    # the embedding's output times this (exact for 1.0)
    embed_scale: float = 1.0
    # the queries times this before the attention (exact for 1.0; Gemma 3)
    query_scale: float = 1.0
    # Why `rollout.name=auto` does not pick native for this family yet (`native` still runs it), or
    # None.
    not_by_default: str | None = None
    # Why rollout.batch_invariant's arithmetic (rollout/native/invariant.py) cannot run this family,
    # or None: it covers dense decoders with full attention and a SiLU-gated MLP.
    batch_invariant_blocker: str | None = None

    def __init__(self, config):
        self.config = config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.eps = config.rms_norm_eps

    def layers(self, fns, weights, x: Tensor, positions: Tensor, attend: Callable) -> Tensor:
        """The decoder's layers over the residual stream x [N, hidden] of tokens at `positions` [N]
        -> the final normed hidden state [N, hidden]. The one layer loop: decoding and both prefills
        differ only in `attend(layer index, q, k, v)`, which writes K and V to the cache and attends
        as each needs. `fns`: the step functions, compiled or not (layers.StepFunctions); where
        they have a `projection`, q and k come as projected and `attend` also takes the rotary=
        that makes them attention's inputs (attention.Rotary)."""
        rotary = {
            kind: fns.rope(positions, inv_freq, scale, x.dtype)
            for kind, (inv_freq, scale) in weights.rotary.items()
        }  # [N, 1, D] cos and sin of each kind
        first_norm = weights.layers[0].input_norm
        h = x if first_norm is None else fns.norm(x, first_norm, self.eps)
        for i, layer in enumerate(weights.layers):
            cos, sin = rotary[self.rope_kind(i)]
            args = self.attention_args(layer)
            if fns.projection is None:
                attention = attend(i, *fns.attention_inputs(h, cos, sin, args))
            else:
                # the attention kernel norms and rotates the heads itself
                rotation = Rotary(cos, sin, args.q_norm, args.k_norm, args.eps)
                attention = attend(i, *fns.projection(h, args), rotary=rotation)
            x, h = fns.after_attention[self.layer_kind(layer)](
                x, attention, weights.norm_after(i), self.after_attention_args(layer)
            )
        return h

    def rotary_frequencies(self, model) -> dict[str, tuple[Tensor, float]]:
        """RoPE's inverse frequencies and output scale of each kind of layer, read once from the
        model (training never changes them)."""
        rotary = model.get_decoder().rotary_emb
        return {"default": (rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0)))}

    def rope_kind(self, layer: int) -> str:
        return "default"

    def window(self, layer: int) -> int | None:
        """The cache columns a query of this layer sees back from its own (sliding window), or None:
        all."""
        return None

    @classmethod
    def unsupported_reason(cls, config) -> str | None:
        """Why this family cannot run a model of this config (one of its model types), or None."""
        rope = (
            getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        )
        if rope.get("rope_type", rope.get("type", "default")) not in STATIC_ROPE:
            return f"rope type {rope.get('rope_type')!r} (native supports {sorted(STATIC_ROPE)})"
        return None

    @abstractmethod
    def hf_weight_map(self, layer) -> dict[str, list[Tensor]]:
        """The family's HF weight map (as nano-vllm's packed_modules_mapping): a Hugging Face
        decoder layer's tensors by the LayerWeights field they fill, stacked by rows."""

    def layer_kind(self, layer: LayerWeights) -> str:
        """Which of `after_attention` the layer runs."""
        return "mlp"

    def attention_args(self, layer: LayerWeights) -> AttentionArgs:
        """What `attention_inputs` takes after h, cos and sin."""
        return layer_args(AttentionArgs, layer, self)

    def after_attention_args(self, layer: LayerWeights) -> tuple:
        """What the layer's `after_attention` function takes after x, attention and the next norm:
        a dense layer's MlpArgs (a family with other kinds of layer adds theirs)."""
        return layer_args(MlpArgs, layer, self)


def layer_args(args_type: type[Args], layer: LayerWeights, family: Family) -> Args:
    """A step function's argument, filled by name: args_type's first fields are the layer's
    tensors of those names (LayerWeights fields), the rest the family's attributes of those names
    (its constants). Names, not positions: no two tensors of one shape can trade places."""
    tensors, constants = _getters(args_type)
    return args_type._make((*tensors(layer), *constants(family)))


@cache
def _getters(args_type: type) -> tuple[Callable, Callable]:
    """(the layer's tensors, the family's constants) of args_type, each read as a tuple."""
    layer_fields = {f.name for f in fields(LayerWeights)}
    names = args_type._fields
    tensors = [name for name in names if name in layer_fields]
    if tuple(tensors) != names[: len(tensors)]:
        raise TypeError(f"{args_type.__name__}: the layer's tensors come before the constants")
    return _tuple_getter(tensors), _tuple_getter(names[len(tensors) :])


def _tuple_getter(names) -> Callable:
    # attrgetter of one name gives the value itself, not a tuple of it
    getter = attrgetter(*names) if names else (lambda _: ())
    return (lambda obj: (getter(obj),)) if len(names) == 1 else getter
