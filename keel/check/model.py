"""`keel check`'s tokenizer and model checks, from the files alone (no weights loaded): the
tokenizer's EOS and pad, its vocabulary and special tokens against the model's, the token budget
against the model's positions, the weight files' shapes, and LoRA's targets (trap 7)."""

from __future__ import annotations

from pathlib import Path

import torch

from keel.check.findings import PASS, WARN, Finding, need
from keel.config.rules import lengths_within
from keel.config.schema import KeelConfig
from keel.errors import TOKEN_BUDGET, TOKENIZER_MISMATCH, VOCAB_MISMATCH, WEIGHTS_BROKEN, KeelError


def check_tokenizer(cfg: KeelConfig, context: dict) -> list[Finding]:
    from transformers import AutoTokenizer

    from keel.models.load import check_model_dir, load_tokenizer

    path = check_model_dir(cfg.actor_rollout_ref.model.path)
    raw = AutoTokenizer.from_pretrained(
        path, trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code
    )
    context["tokenizer"] = tokenizer = load_tokenizer(
        path, cfg.actor_rollout_ref.model.trust_remote_code
    )
    found = [Finding(PASS, "tokenizer", f"EOS {tokenizer.eos_token!r}, {len(tokenizer)} tokens")]
    if raw.pad_token_id is None:
        context["pad_from_eos"] = True
        found.append(
            Finding(WARN, "tokenizer", f"no pad token: keel pads with EOS {tokenizer.eos_token!r}")
        )
    return found


def check_model(cfg: KeelConfig, context: dict) -> list[Finding]:
    from transformers import AutoConfig

    from keel.models.load import check_model_dir

    tokenizer = need(context, "tokenizer")
    # a Hub id: its snapshot in the local cache
    path = check_model_dir(cfg.actor_rollout_ref.model.path)
    model_cfg = AutoConfig.from_pretrained(
        path, trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code
    )
    context["model_config"] = model_cfg
    vocab = model_cfg.vocab_size
    _check_vocabulary(tokenizer, vocab, path)
    budget, limit = check_positions(
        cfg,
        model_cfg,
        "policy",
        "use a model with a longer context (rollout.max_model_len cannot go past the model's "
        "positions)",
    )
    from keel.models.load import meta_model
    from keel.models.weight_check import check_weights_match

    found = check_special_tokens(tokenizer, model_cfg, path, context.get("pad_from_eos"))
    # built once: the weights check compares its shapes, the memory estimate counts its parameters
    try:
        model = meta_model(model_cfg, cfg.actor_rollout_ref.model.trust_remote_code)
        context["parameters"] = sum(p.numel() for p in model.parameters())
    # an architecture that will not build on the meta device is checked when it loads
    except Exception:
        model = None
    weights, unmatched = check_weights_match(path, model_cfg, model)
    if unmatched:
        found.append(Finding(WARN, "model", unmatched, WEIGHTS_BROKEN))
    found += _plan_lora(cfg, model, context)
    found.insert(
        0,
        Finding(
            PASS,
            "model",
            f"{model_cfg.model_type}, vocab {vocab}, {budget} of {limit or '?'} positions "
            f"used; weights: {weights}",
        ),
    )
    if tokenizer.model_max_length < budget:
        found.append(
            Finding(
                WARN,
                "model",
                f"tokenizer model_max_length={tokenizer.model_max_length} is below "
                f"the {budget}-token budget; transformers may warn or truncate",
            )
        )
    return found


def _check_vocabulary(tokenizer, vocab: int, path) -> None:
    """Every id the tokenizer gives, its special tokens' too, must have a row in the embedding."""
    from keel.models.tokenizer_match import vocab_fix

    if len(tokenizer) > vocab:
        raise KeelError(
            VOCAB_MISMATCH,
            f"the tokenizer has {len(tokenizer)} tokens but the model's embedding "
            f"has {vocab} rows: ids >= {vocab} would index out of range",
            vocab_fix(path, len(tokenizer)),
        )
    special = {name: getattr(tokenizer, f"{name}_token_id") for name in ("eos", "pad", "bos")}
    bad = {k: v for k, v in special.items() if v is not None and v >= vocab}
    if bad:
        raise KeelError(
            VOCAB_MISMATCH,
            f"special token ids {bad} are outside the model's vocabulary of {vocab}",
            vocab_fix(path, max(bad.values()) + 1),
        )


def _plan_lora(cfg: KeelConfig, model, context: dict) -> list[Finding]:
    """Trap 7 on the meta model (no weights loaded), for the policy and a LoRA critic (whose
    backbone is the same decoder); the plans go to the memory estimate."""
    from keel.models.lora import plan_lora

    sections = [("actor", "actor_rollout_ref.model", cfg.actor_rollout_ref.model)]
    # a critic of its own model is planned when it loads
    if cfg.critic_enabled and not cfg.critic.model.path:
        sections.append(("critic", "critic.model", cfg.critic.model))
    found, plans = [], context.setdefault("lora_trainable", {})
    for role, key, m in sections:
        if m.lora_rank and model is not None:
            plan = plan_lora(
                model, m.lora_rank, m.target_modules, m.exclude_modules, m.modules_to_save, key
            )
            plans[role] = plan.trainable
            found.append(Finding(PASS, "lora", f"{role}: {plan.summary()}"))
    return found


def check_special_tokens(tokenizer, model_cfg, path: str, pad_from_eos: bool) -> list[Finding]:
    """EOS, pad and BOS of the tokenizer against the model's configs: warnings with the fix, or an
    error when they disagree on two or more (a tokenizer from another model). A pad keel chose
    itself (EOS, the tokenizer having none) is not the tokenizer's to compare."""
    from transformers import GenerationConfig

    from keel.models.tokenizer_match import agree_fix, special_token_mismatches

    found, generation_eos = [], None
    if Path(path, "generation_config.json").is_file():
        try:
            generation_eos = GenerationConfig.from_pretrained(path).eos_token_id
        except (OSError, ValueError) as e:
            found.append(
                Finding(
                    WARN,
                    "model",
                    f"generation_config.json in {path} cannot be read ({e}); its EOS ids are "
                    "not compared",
                )
            )
    mismatches = special_token_mismatches(
        tokenizer, model_cfg, generation_eos, compare_pad=not pad_from_eos, path=path
    )
    if len(mismatches) >= 2:
        raise KeelError(
            TOKENIZER_MISMATCH,
            "; ".join(what for what, _ in mismatches)
            + ": the tokenizer looks like another model's",
            agree_fix(mismatches),
        )
    return found + [
        Finding(WARN, "model", what, TOKENIZER_MISMATCH, fix) for what, fix in mismatches
    ]


def check_positions(cfg: KeelConfig, model_cfg, whose: str, other: str) -> tuple[int, int | None]:
    """Prompt plus response within `whose` model's positions (a coded error naming the lengths
    that fit, or `other`); returns (those tokens, the positions: None where unknown)."""
    budget = cfg.data.max_prompt_length + cfg.data.max_response_length
    limit = getattr(model_cfg, "max_position_embeddings", None)
    if limit is not None and budget > limit:
        raise KeelError(
            TOKEN_BUDGET,
            f"data.max_prompt_length + data.max_response_length = {budget} tokens, over the "
            f"{whose}'s max_position_embeddings={limit}",
            lengths_within(cfg, limit, f"the {whose}'s max_position_embeddings") + f", or {other}",
        )
    return budget, limit


def run_device(cfg: KeelConfig) -> torch.device:
    """The device the run resolves to (the CPU where that fails: the device check reports it)."""
    from keel.models.load import resolve_device

    try:
        return resolve_device(cfg.trainer.device)
    except KeelError:
        return torch.device("cpu")


def compute_dtype(cfg: KeelConfig) -> torch.dtype:
    """The policy's compute dtype on the device the run resolves to."""
    from keel.models.load import resolve_dtype

    return resolve_dtype(cfg.actor_rollout_ref.model.dtype, run_device(cfg))
