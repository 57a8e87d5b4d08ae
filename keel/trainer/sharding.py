"""DDP or FSDP for the policy when the config does not say (actor fsdp_size unset) and there are
several workers: a model whose whole training state fits each GPU with room to spare is replicated
(DDP: gradients all-reduced once per mini-batch, no all-gather per layer in every forward and
backward), a larger one is sharded over every worker (FSDP), as is any policy the hf engine would
generate with. The choice is made once, on the driver, kept in the plan (the config is not written
to), logged with its reason and shown by `keel check`; a config that sets any of the actor's
fsdp_config keys (fsdp_size, an offload, ...) is taken as it is."""

from __future__ import annotations

from dataclasses import replace

import torch

from keel.config.memory import estimate_memory_gb
from keel.config.plan import Plan, Sharding
from keel.config.schema import KeelConfig
from keel.models.load import resolve_device, resolve_dtype
from keel.rollout.native.models import unsupported_reason
from keel.training.forward import LOGITS_CHUNK_TOKENS

KEY = "actor_rollout_ref.actor.fsdp_config.fsdp_size"
# a whole replica's estimate within this share of a GPU's memory: replicate
REPLICA_SHARE = 0.5


def choose_sharding(
    cfg: KeelConfig,
    plan: Plan,
    model_cfg,
    params: int,
    device_bytes: int | None,
    lora_trainable: dict[str, int] | None = None,
) -> Sharding | None:
    """The actor's fsdp_size when the config left it unset, and why; None when there was nothing
    to choose (one worker, or the config says). A plan that holds a choice keeps it. `device_bytes`:
    one GPU's memory, None where the driver has none to measure (FSDP then, as before)."""
    if not _left_to_keel(cfg, plan):
        return None
    return plan.sharding or _reason(cfg, model_cfg, params, device_bytes, lora_trainable)


def _left_to_keel(cfg: KeelConfig, plan: Plan) -> bool:
    """Several workers, and a config that sets none of the actor's FSDP keys (one built in code,
    with no record of what it set, is taken as it is)."""
    return cfg.world_size > 1 and plan.left_to_keel("actor_rollout_ref.actor.fsdp_config.")


def _reason(
    cfg: KeelConfig,
    model_cfg,
    params: int,
    device_bytes: int | None,
    lora_trainable: dict[str, int] | None,
) -> Sharding:
    """fsdp_size 1 or -1, and why."""
    world = cfg.world_size
    sharded = f"FSDP over all {world} workers ({KEY}=-1)"
    if cfg.actor_rollout_ref.rollout.name == "hf" or unsupported_reason(model_cfg) is not None:
        return Sharding(
            -1,
            f"{sharded}: the rollout engine is hf, which would generate with the replicated "
            "training module",
        )
    if device_bytes is None:
        return Sharding(-1, f"{sharded}: no GPU here to size a whole replica against")
    replica = replace(cfg.actor_rollout_ref.actor.fsdp_config, fsdp_size=1)
    device = resolve_device(cfg.trainer.device)
    need = estimate_memory_gb(
        cfg,
        model_cfg,
        params,
        compute_bytes=resolve_dtype(cfg.actor_rollout_ref.model.dtype, device).itemsize,
        native_rollout=True,
        logits_chunk_tokens=LOGITS_CHUNK_TOKENS,
        lora_trainable=lora_trainable,
        actor_fsdp=replica,
    )["total"]
    gpu = device_bytes / 2**30
    if need > REPLICA_SHARE * gpu:
        return Sharding(
            -1,
            f"{sharded}: a whole replica would need about {need:.1f} GB of each GPU's {gpu:.0f} GB",
        )
    return Sharding(
        1,
        f"DDP ({KEY}=1): a whole replica needs about {need:.1f} GB of each GPU's {gpu:.0f} GB, so "
        "every worker keeps the whole model and gradients are all-reduced once per mini-batch",
    )


def decide_sharding(cfg: KeelConfig, plan: Plan) -> Plan:
    """The plan with choose_sharding's choice, for a run about to start its workers: the model's
    architecture read from its path (its parameters counted on the meta device). `keel check`'s
    choice, made with what it loaded, is kept."""
    if not _left_to_keel(cfg, plan) or plan.sharding:
        return plan
    from transformers import AutoConfig

    from keel.models.load import check_model_dir, meta_model
    from keel.models.lora import plan_lora

    model = cfg.actor_rollout_ref.model
    # an architecture that does not build on the meta device is sharded, as before
    try:
        model_cfg = AutoConfig.from_pretrained(
            check_model_dir(model.path), trust_remote_code=model.trust_remote_code
        )
        meta = meta_model(model_cfg, model.trust_remote_code)
        lora = (
            {
                "actor": plan_lora(
                    meta,
                    model.lora_rank,
                    model.target_modules,
                    model.exclude_modules,
                    model.modules_to_save,
                    "actor_rollout_ref.model",
                ).trainable
            }
            if model.lora_rank
            else {}
        )
        params = sum(p.numel() for p in meta.parameters())
        sharding = choose_sharding(cfg, plan, model_cfg, params, gpu_bytes(cfg), lora)
    except Exception as error:  # noqa: BLE001 - sizing is advice; the run goes on sharded
        sharding = Sharding(
            -1,
            f"FSDP over all {cfg.world_size} workers ({KEY}=-1): the model could "
            f"not be sized ({type(error).__name__}: {str(error)[:120]})",
        )
    return plan.with_sharding(sharding)


def gpu_bytes(cfg: KeelConfig) -> int | None:
    """One GPU's memory where the run's device is a GPU this process sees, else None."""
    if resolve_device(cfg.trainer.device).type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory
