"""LoRA through peft, with its traps caught before any GPU time.

Trap 7: `target_modules` that match nothing, or only some of a decoder layer's projections (the
rest of the layer then trains nothing, and a model "with LoRA" learns little), or the tied
embedding / `lm_head`, or a parameter left trainable outside the adapters (an embedding with
requires_grad), are errors that list what the model has. The frozen base is cast to the compute
dtype and carries no optimiser state; only the adapters (and `modules_to_save`) train, in float32.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
from torch import nn

from keel.errors import LORA_TARGETS, KeelError
from keel.errors.fixes import overrides, setting

ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoraPlan:
    """What LoRA will cover on a model, decided before it is applied (and printed by keel check)."""

    # leaf names of the linear layers that get adapters (q_proj, ...)
    targets: tuple[str, ...]
    # the leaf names every decoder layer has
    layer_linears: tuple[str, ...]
    # parameters that will train (adapters and modules_to_save)
    trainable: int
    # parameters of the model with adapters
    total: int
    # a mixture's layer modules that get no adapters (experts, router, MLPs)
    frozen_other: tuple[str, ...] = ()

    def summary(self) -> str:
        share = self.trainable / max(self.total, 1)
        frozen = (
            f"; {', '.join(self.frozen_other)} frozen: a mixture's experts, router and dense "
            "MLPs get no adapters"
            if self.frozen_other
            else ""
        )
        return (
            f"LoRA on {', '.join(self.targets)} of every decoder layer (lm_head and embeddings "
            f"frozen{frozen}): {self.trainable:,} trainable parameters, {100 * share:.2f}% of "
            f"{self.total:,}"
        )


def decoder_linears(model: nn.Module) -> dict[str, list[str]]:
    """{leaf name: full names} of the linear layers inside the decoder's blocks (lm_head is not
    one)."""
    found: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and ".layers." in f".{name}":
            found.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    return found


def other_layer_weights(model: nn.Module) -> set[str]:
    """Leaf names of modules inside the decoder's blocks that hold matrices of their own but are not
    linear layers: a mixture's stacked experts (`experts`) and its router (`gate`)."""
    return {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if ".layers." in f".{name}"
        and not isinstance(module, nn.Linear)
        and any(p.dim() >= 2 for p in module.parameters(recurse=False))
    }


MLP_NAMES = {"gate_proj", "up_proj", "down_proj"}


def _refuse_expert_names(target_modules: list[str], key: str, linears: dict) -> None:
    """peft (0.18 and later, on transformers 5) puts adapters named after an MLP's projections on a
    mixture's stacked experts, which the native engine does not run; keel adapts the attention."""
    named = sorted(MLP_NAMES & set(target_modules))
    if named:
        raise KeelError(
            LORA_TARGETS,
            f"{key}.target_modules names {named}: on a mixture of experts peft puts those "
            "adapters on the stacked experts, which keel's LoRA does not adapt (the experts and "
            "any dense MLP stay frozen; the attention's projections "
            f"{sorted(set(linears) - MLP_NAMES)} train)",
            f"set {setting(key + '.target_modules', ALL_LINEAR)}",
        )


def _refuse_names_outside(
    outside: list[str],
    target_modules: list[str],
    linears: dict,
    others: set[str],
    model: nn.Module,
    key: str,
) -> None:
    """target_modules names that are no decoder layer's linear layer: a tied embedding, a mixture's
    experts or router, or nothing this model has."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    if set(outside) & {"lm_head", "embed_tokens"} and tied:
        kept = [t for t in target_modules if t not in outside] or [ALL_LINEAR]
        raise KeelError(
            LORA_TARGETS,
            f"{key}.target_modules names {outside}: with tied embeddings an adapter on "
            "lm_head or the embedding would untie them",
            f"set {setting(key + '.target_modules', kept)}",
        )
    if set(outside) & others:
        raise KeelError(
            LORA_TARGETS,
            f"{key}.target_modules names {sorted(set(outside) & others)}: a mixture's stacked "
            "experts and router are not linear layers, and keel's LoRA adapts linear layers only "
            f"(this model's are {sorted(linears)})",
            f"set {setting(key + '.target_modules', ALL_LINEAR)} (the attention's projections; "
            "the experts stay frozen)",
        )
    if outside:
        raise KeelError(
            LORA_TARGETS,
            f"{key}.target_modules={target_modules} names {outside}, which this model's "
            f"decoder layers do not have; they have {sorted(linears)}",
            f"set {setting(key + '.target_modules', ALL_LINEAR)}, or names from {sorted(linears)}",
        )


def plan_lora(
    model: nn.Module,
    rank: int,
    target_modules: list[str],
    exclude_modules: list[str],
    modules_to_save: list[str],
    key: str,
) -> LoraPlan:
    """The plan, or a KeelError (trap 7) saying what the model has."""
    linears = decoder_linears(model)
    others = other_layer_weights(model)
    # a mixture: its dense MLPs' names are the experts' names to peft
    if "experts" in others:
        _refuse_expert_names(target_modules, key, linears)
        others |= MLP_NAMES & set(linears)
        linears = {leaf: names for leaf, names in linears.items() if leaf not in MLP_NAMES}
    wanted = set(linears) if target_modules == [ALL_LINEAR] else set(target_modules)
    excluded = {
        leaf
        for leaf in linears
        for pattern in exclude_modules
        if fnmatch.fnmatchcase(leaf, pattern)
    }
    _refuse_names_outside(
        sorted(wanted - set(linears)), target_modules, linears, others, model, key
    )
    targets = sorted(wanted - excluded)
    if not targets:
        raise KeelError(
            LORA_TARGETS,
            f"{key}.target_modules={target_modules} (exclude_modules={exclude_modules}) "
            f"matches none of this model's linear layers {sorted(linears)}: nothing would train",
            f"set {overrides({key + '.target_modules': ALL_LINEAR, key + '.exclude_modules': []})}",
        )
    if len(targets) < len(linears):
        raise KeelError(
            LORA_TARGETS,
            f"{key}: adapters on {targets} only; each decoder layer also has "
            f"{sorted(set(linears) - set(targets))}, which would train nothing",
            f"set {overrides({key + '.target_modules': ALL_LINEAR, key + '.exclude_modules': []})} "
            "(every projection of every layer), or list them all",
        )
    per_target = sum(
        rank * (m.in_features + m.out_features)
        for leaf in targets
        for name in linears[leaf]
        for m in [model.get_submodule(name)]
    )
    saved = sum(
        p.numel()
        for name, p in model.named_parameters()
        if any(
            fnmatch.fnmatchcase(name.rsplit(".", 1)[0].rsplit(".", 1)[-1], pattern)
            for pattern in modules_to_save
        )
    )
    total = sum(p.numel() for p in model.parameters()) + per_target
    return LoraPlan(
        tuple(targets), tuple(sorted(linears)), per_target + saved, total, tuple(sorted(others))
    )


def apply_lora(
    model: nn.Module,
    plan: LoraPlan,
    rank: int,
    alpha: int,
    modules_to_save: list[str],
    compute_dtype: torch.dtype,
    adapter_path: str | None = None,
):
    """The model with peft adapters: the base frozen in the compute dtype, adapters in float32."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter_path:
        peft_model = PeftModel.from_pretrained(model, adapter_path, is_trainable=True)
    else:
        config = LoraConfig(
            r=rank,
            lora_alpha=alpha,
            target_modules=list(plan.targets),
            lora_dropout=0.0,
            modules_to_save=modules_to_save or None,
            bias="none",
        )
        peft_model = get_peft_model(model, config)
    for param in peft_model.parameters():
        if not param.requires_grad and param.dtype.is_floating_point:
            # frozen: never float32, no optimiser state
            param.data = param.data.to(compute_dtype)
        elif param.requires_grad:
            param.data = param.data.float()
    require_only_adapters_train(peft_model, modules_to_save)
    return peft_model


def require_only_adapters_train(model: nn.Module, modules_to_save: list[str]) -> None:
    """Trap 7's last part: a parameter that trains outside the adapters (an embedding left with
    requires_grad) changes the base behind LoRA's back."""
    stray = [
        name
        for name, p in model.named_parameters()
        if p.requires_grad
        and "lora_" not in name
        and not any(f".{m}." in f".{name}." or "modules_to_save" in name for m in modules_to_save)
    ]
    if stray:
        raise KeelError(
            LORA_TARGETS,
            f"{len(stray)} parameters outside the LoRA adapters would train, e.g. {stray[:3]}",
            "freeze them, or name their modules in model.modules_to_save",
        )


def hf_name(peft_name: str) -> str:
    """A peft parameter's name as the Hugging Face model names it (the base layer's own)."""
    return peft_name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def frozen_base(peft_model):
    """(Hugging Face name, parameter) of the frozen base: what the rollout engine can share rather
    than copy. modules_to_save's originals are left out, so the engine holds their trained
    copies."""
    for name, param in peft_model.named_parameters():
        if (
            not param.requires_grad
            and ".original_module." not in name
            and ".modules_to_save." not in name
        ):
            yield hf_name(name), param


@torch.no_grad()
def adapter_weights(peft_model):
    """(the adapted layer's Hugging Face weight name, A, B times its scaling) for each LoRA layer:
    what the rollout engine applies unmerged after an update (the base never changes)."""
    from peft.tuners.lora import LoraLayer

    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer) and module.active_adapters:
            adapter = module.active_adapters[0]
            a, b = (_whole(m[adapter].weight) for m in (module.lora_A, module.lora_B))
            yield hf_name(name + ".base_layer.weight"), a, b * module.scaling[adapter]


def trained_in_full(peft_model):
    """(Hugging Face name, tensor) of modules_to_save's trained copies: the engine loads them
    whole."""
    for name, param in peft_model.named_parameters():
        if ".modules_to_save." in name:
            yield (
                name.removeprefix("base_model.model.").replace(".modules_to_save.default", ""),
                _whole(param),
            )


def _whole(param) -> torch.Tensor:
    """A parameter's whole tensor: gathered from every rank when FSDP2 shards it (a collective:
    every rank walks the same parameters in the same order)."""
    tensor = param.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
