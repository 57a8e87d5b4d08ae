"""The native engine's model definitions, one module a family: which checkpoints it runs, where
each weight comes from, and the decoder layer's math around the attention kernel. The engine's
loops (engine.py, batching.py) call a family only through `Family`; adding one is a module here and
a line in FAMILIES."""

from __future__ import annotations

from keel.rollout.native.models.base import Family, LayerWeights
from keel.rollout.native.models.gemma3 import Gemma3Family
from keel.rollout.native.models.gpt_oss import GptOssFamily
from keel.rollout.native.models.llama import LlamaFamily
from keel.rollout.native.models.olmo2 import Olmo2Family
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
    for family in (LlamaFamily, Qwen3MoeFamily, Gemma3Family, Olmo2Family, GptOssFamily)
    for model_type in family.model_types
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
