"""Which rollout engine a run uses: `rollout.name` auto | native | hf."""

from __future__ import annotations

import copy
import logging

import torch

from keel.errors import BATCH_INVARIANT_UNSUPPORTED, INCOMPATIBLE_OPTIONS, KeelError
from keel.rollout.base import RolloutEngine
from keel.rollout.hf import HFRolloutEngine
from keel.rollout.native import NativeRolloutEngine, not_by_default, unsupported_reason
from keel.rollout.native.invariant import unsupported_reason as invariant_unsupported
from keel.rollout.native.models import family_for

log = logging.getLogger("keel")

# What falling back costs, as measured (issue 29, one H200, t1's work: 128 samples of 256 tokens).
HF_COST = (
    "hf generates about 30x slower: t1's 128 samples of 256 tokens took 12.8 s on hf for "
    "Qwen3-0.6B's shapes, 0.39 s on native for Qwen2.5-0.5B's, on one H200"
)


def engine_for(name: str, model_config, batch_invariant: bool = False) -> tuple[str, str | None]:
    """(the engine `rollout.name` gives this model, why native cannot run it or None). `auto` takes
    native where it supports the model; an explicit `native` that cannot run is an error rather
    than a silent switch. `batch_invariant` (rollout.batch_invariant) needs native and a model its
    arithmetic covers: KEEL-C030 else."""
    reason = unsupported_reason(model_config) if name != "hf" else None
    if batch_invariant:
        _check_batch_invariant(model_config, "rollout.name=hf" if name == "hf" else reason)
    elif name == "auto" and not reason:
        reason = not_by_default(model_config)
    if name == "native" and reason:
        raise KeelError(
            INCOMPATIBLE_OPTIONS,
            f"actor_rollout_ref.rollout.name=native does not support this model: {reason}",
            "set `actor_rollout_ref.rollout.name=hf`, or auto (which falls back to hf)",
        )
    return ("hf" if name == "hf" or reason else "native"), reason


def _check_batch_invariant(model_config, reason: str | None) -> None:
    """KEEL-C030 where the native engine, or its batch-invariant arithmetic, cannot run the
    model."""
    blocker = reason or invariant_unsupported(family_for(model_config))
    if blocker:
        key = "actor_rollout_ref.rollout.batch_invariant"
        raise KeelError(
            BATCH_INVARIANT_UNSUPPORTED,
            f"{key}=true: the native engine's batch-invariant arithmetic does not cover this "
            f"model ({model_config.model_type}): {blocker}",
            f"set `{key}=false`",
        )


def make_rollout_engine(
    rollout_cfg,
    model,
    tokenizer,
    device: torch.device,
    dtype: torch.dtype,
    log_choice: bool,
    will_be_sharded: bool = False,
    lora: bool = False,
) -> RolloutEngine:
    """The engine `engine_for` picks, logged with why. Each engine computes in `dtype` on its own
    terms (hf under autocast, native with weights cast once per update).

    `will_be_sharded`: the policy module is about to be sharded. The native engine keeps only its
    own decode weights; hf generates with a module, so it gets a whole copy of its own. A sharded
    LoRA policy needs native: only it applies adapters synced on their own to a base it holds."""
    engine, reason = engine_for(rollout_cfg.name, model.config, rollout_cfg.batch_invariant)
    if engine == "hf" and will_be_sharded and lora:
        why = f"native does not support this model ({reason})" if reason else "rollout.name=hf"
        raise KeelError(
            INCOMPATIBLE_OPTIONS,
            f"LoRA on a sharded policy needs the native rollout engine, and {why}",
            "replicate the policy instead of sharding it: "
            "`actor_rollout_ref.actor.fsdp_config.fsdp_size=1`, or train on one worker "
            "(`trainer.n_gpus_per_node=1`), or `actor_rollout_ref.model.lora_rank=0`",
        )
    if engine == "hf":
        if log_choice:
            log.info(
                "rollout engine: hf (%s)",
                f"native does not support {reason}; {HF_COST}" if reason else "rollout.name=hf",
            )
        return HFRolloutEngine(
            copy.deepcopy(model) if will_be_sharded else model,
            tokenizer,
            rollout_cfg.max_num_seqs,
            dtype,
            owns_weights=will_be_sharded,
        )
    if log_choice:
        log.info(
            "rollout engine: native (%s, %s)",
            model.config.model_type,
            "batch-invariant, eager"
            if rollout_cfg.batch_invariant
            else "eager"
            if rollout_cfg.enforce_eager or device.type != "cuda"
            else "CUDA graphs",
        )
    return NativeRolloutEngine(
        model,
        tokenizer,
        rollout_cfg.max_num_seqs,
        dtype,
        enforce_eager=rollout_cfg.enforce_eager,
        free_cache_engine=rollout_cfg.free_cache_engine,
        memory_utilization=rollout_cfg.gpu_memory_utilization,
        max_num_batched_tokens=rollout_cfg.max_num_batched_tokens,
        batch_invariant=rollout_cfg.batch_invariant,
    )
