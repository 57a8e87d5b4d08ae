"""The native engine's model definitions, one module a family: which checkpoints it runs, where
each weight comes from (its HF weight map), and the decoder layer's math around the attention
kernel. The engine's loops (engine.py, batching.py) call a family only through `Family`.

A new family is two units, each registered by one line:
1. `models/<family>.py` here: a `Family` subclass (or a subclass of the family it resembles, as
   Qwen3-MoE's of Llama's) with `facts` (its record, below), `hf_weight_map(layer)` (each
   LayerWeights field as the Hugging Face layer's tensors it stacks, as nano-vllm's
   packed_modules_mapping) and `unsupported_reason`; and only where its layer math differs, its
   step functions (`attention_inputs`, `after_attention`, `norm`). A step function takes the layer
   as one NamedTuple, `layers.AttentionArgs` / `layers.MlpArgs` or one of its own whose fields are
   named as the LayerWeights tensors and then the family's constants (`base.layer_args` fills it).
   Then its line in FAMILIES below.
2. its facts record in `keel/models/families.py` (model types, which take the trainer's plain
   lm_head path and why, its tiny test config, `active_parameters`) and its line in RECORDS there.
Nothing else needs a line: the trainer, the tiny models and the benchmark read the record (a
released shape to measure in bench/workloads.py is optional).
A dense Llama-shaped family with other module names (fused qkv_proj, gate_up_proj) is a
LlamaFamily subclass with its own `hf_weight_map`. A tensor kind no family had widens
`LayerWeights` (base.py) too. Its tests: a row in the per-family lists of
tests/unit/test_native_rollout.py and tests/gpu/test_native_cuda.py."""

from __future__ import annotations

from keel.rollout.native.models.base import Family, LayerWeights
from keel.rollout.native.models.gemma3 import Gemma3Family
from keel.rollout.native.models.gpt_oss import GptOssFamily
from keel.rollout.native.models.llama import LlamaFamily
from keel.rollout.native.models.olmo2 import Olmo2Family
from keel.rollout.native.models.phi3 import Phi3Family
from keel.rollout.native.models.qwen3_moe import Qwen3MoeFamily

__all__ = [
    "FAMILIES",
    "Family",
    "LayerWeights",
    "family_for",
    "not_by_default",
    "unsupported_reason",
]

FAMILIES: dict[str, type[Family]] = {
    model_type: family
    for family in (LlamaFamily, Qwen3MoeFamily, Gemma3Family, Olmo2Family, GptOssFamily, Phi3Family)
    for model_type in family.facts.model_types
}


def family_for(config) -> Family:
    """The family that runs a model of this (Hugging Face) config; KeyError when none does."""
    return FAMILIES[config.model_type](config)


def unsupported_reason(config) -> str | None:
    """Why the native engine cannot run a model of this config, or None when it can."""
    family = FAMILIES.get(config.model_type)
    if family is None:
        return f"model_type {config.model_type!r} (native supports {sorted(FAMILIES)})"
    return family.unsupported_reason(config)


def not_by_default(config) -> str | None:
    """Why `rollout.name=auto` does not pick the native engine for a model it can run, or None."""
    family = FAMILIES.get(config.model_type)
    return family.not_by_default if family else None
