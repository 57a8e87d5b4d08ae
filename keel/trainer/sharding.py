"""DDP or FSDP for the policy when the config does not say (actor fsdp_size unset) and there are
several workers: a model whose whole training state fits each GPU with room to spare is replicated
(DDP: gradients all-reduced once per mini-batch, no all-gather per layer in every forward and
backward), a larger one is sharded over every worker (FSDP), as is any policy the hf engine would
generate with. The choice is made once, on the driver, logged with its reason and shown by `keel
check`; a config that sets any of the actor's fsdp_config keys (fsdp_size, an offload, ...) is
taken as it is."""

from __future__ import annotations

import copy

import torch

from keel.config.memory import estimate_memory_gb
from keel.config.schema import KeelConfig
from keel.models.load import resolve_device, resolve_dtype
from keel.rollout.native.models import unsupported_reason
from keel.training.forward import LOGITS_CHUNK_TOKENS

KEY = "actor_rollout_ref.actor.fsdp_config.fsdp_size"
# a whole replica's estimate within this share of a GPU's memory: replicate
REPLICA_SHARE = 0.5


def choose_sharding(
    cfg: KeelConfig,
    model_cfg,
    params: int,
    device_bytes: int | None,
    lora_trainable: dict[str, int] | None = None,
) -> str | None:
    """Sets the actor's fsdp_size on `cfg` when the config left it unset -> why, or None when there
    was nothing to choose (one worker, or the config says). `device_bytes`: one GPU's memory, None
    where the driver has none to measure (FSDP then, as before)."""
    if not _left_to_keel(cfg):
        return None
    why = getattr(cfg, "sharding", None) or _reason(
        cfg, model_cfg, params, device_bytes, lora_trainable
    )
    # not a field: chosen once, by keel check or the trainer
    object.__setattr__(cfg, "sharding", why)
    return why


def _left_to_keel(cfg: KeelConfig) -> bool:
    """Several workers, and a config that sets none of the actor's FSDP keys (one built in code, with
    no record of what it set, is taken as it is)."""
    given = getattr(cfg, "given", None)
    return (
        cfg.world_size > 1
        and given is not None
        and not any(key.startswith("actor_rollout_ref.actor.fsdp_config.") for key in given)
    )


def _reason(
    cfg: KeelConfig,
    model_cfg,
    params: int,
    device_bytes: int | None,
    lora_trainable: dict[str, int] | None,
) -> str:
    """Sets fsdp_size (1 or -1) -> why."""
    fsdp, world = cfg.actor_rollout_ref.actor.fsdp_config, cfg.world_size
    fsdp.fsdp_size = -1
    sharded = f"FSDP over all {world} workers ({KEY}=-1)"
    if cfg.actor_rollout_ref.rollout.name == "hf" or unsupported_reason(model_cfg) is not None:
        return f"{sharded}: the rollout engine is hf, which would generate with the replicated training module"
    if device_bytes is None:
        return f"{sharded}: no GPU here to size a whole replica against"
    replica = copy.deepcopy(cfg)
    replica.actor_rollout_ref.actor.fsdp_config.fsdp_size = 1
    device = resolve_device(cfg.trainer.device)
    need = estimate_memory_gb(
        replica,
        model_cfg,
        params,
        compute_bytes=resolve_dtype(cfg.actor_rollout_ref.model.dtype, device).itemsize,
        native_rollout=True,
        logits_chunk_tokens=LOGITS_CHUNK_TOKENS,
        lora_trainable=lora_trainable,
    )["total"]
    gpu = device_bytes / 2**30
    if need > REPLICA_SHARE * gpu:
        return (
            f"{sharded}: a whole replica would need about {need:.1f} GB of each GPU's {gpu:.0f} GB"
        )
    fsdp.fsdp_size = 1
    return (
        f"DDP ({KEY}=1): a whole replica needs about {need:.1f} GB of each GPU's {gpu:.0f} GB, so every "
        "worker keeps the whole model and gradients are all-reduced once per mini-batch"
    )


def decide_sharding(cfg: KeelConfig) -> str | None:
    """choose_sharding for a run about to start its workers: the model's architecture read from its
    path (its parameters counted on the meta device)."""
    if not _left_to_keel(cfg) or getattr(cfg, "sharding", None):
        # keel check's choice, made with what it loaded
        return getattr(cfg, "sharding", None)
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
        return choose_sharding(
            cfg, model_cfg, sum(p.numel() for p in meta.parameters()), gpu_bytes(cfg), lora
        )
    except Exception as error:  # noqa: BLE001 - sizing is advice; the run goes on sharded
        object.__setattr__(
            cfg,
            "sharding",
            f"FSDP over all {cfg.world_size} workers ({KEY}=-1): the model could "
            f"not be sized ({type(error).__name__}: {str(error)[:120]})",
        )
        return cfg.sharding


def gpu_bytes(cfg: KeelConfig) -> int | None:
    """One GPU's memory where the run's device is a GPU this process sees, else None."""
    if resolve_device(cfg.trainer.device).type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory
