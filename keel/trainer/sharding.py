"""DDP or FSDP for the policy when the config does not say (actor fsdp_size unset) and there are
several workers: a model whose whole training state fits each GPU with room to spare is replicated
(DDP: gradients all-reduced once per mini-batch, no all-gather per layer in every forward and
backward), a larger one is sharded over every worker (FSDP). The choice is made once, on the
driver, logged with its reason and shown by `keel check`; a config that sets fsdp_size is taken as
it is, as is one that offloads (offloading is FSDP's)."""

from __future__ import annotations

import copy

import torch

from keel.config.memory import estimate_memory_gb
from keel.config.schema import KeelConfig
from keel.models.load import resolve_device, resolve_dtype
from keel.rollout.native.weights import unsupported_reason
from keel.training.forward import LOGITS_CHUNK_TOKENS

KEY = "actor_rollout_ref.actor.fsdp_config.fsdp_size"
REPLICA_SHARE = 0.5  # a whole replica's estimate within this share of a GPU's memory: replicate


def choose_sharding(cfg: KeelConfig, model_cfg, params: int, device_bytes: int | None,
                    lora_trainable: dict[str, int] | None = None) -> str | None:
    """Sets the actor's fsdp_size on `cfg` when the config left it unset -> why, or None when there
    was nothing to choose (one worker, or the config says). `device_bytes`: one GPU's memory, None
    where the driver has none to measure (FSDP then, as before)."""
    fsdp, world = cfg.actor_rollout_ref.actor.fsdp_config, cfg.world_size
    if world == 1 or KEY in getattr(cfg, "given", ()):
        return None
    sharded = f"FSDP over all {world} workers ({KEY}=-1)"
    if fsdp.param_offload or fsdp.optimizer_offload:
        return f"{sharded}: offloading is FSDP's"
    if device_bytes is None:
        return f"{sharded}: no GPU here to size a whole replica against"
    replica = copy.deepcopy(cfg)
    replica.actor_rollout_ref.actor.fsdp_config.fsdp_size = 1
    device = resolve_device(cfg.trainer.device)
    need = estimate_memory_gb(replica, model_cfg, params,
                              compute_bytes=resolve_dtype(cfg.actor_rollout_ref.model.dtype, device).itemsize,
                              native_rollout=unsupported_reason(model_cfg) is None,
                              logits_chunk_tokens=LOGITS_CHUNK_TOKENS, lora_trainable=lora_trainable)["total"]
    gpu = device_bytes / 2 ** 30
    if need > REPLICA_SHARE * gpu:
        return f"{sharded}: a whole replica would need about {need:.1f} GB of each GPU's {gpu:.0f} GB"
    fsdp.fsdp_size = 1
    return (f"DDP ({KEY}=1): a whole replica needs about {need:.1f} GB of each GPU's {gpu:.0f} GB, so every "
            "worker keeps the whole model and gradients are all-reduced once per mini-batch")


def decide_sharding(cfg: KeelConfig) -> str | None:
    """choose_sharding for a run about to start its workers: the model's architecture read from its
    path (its parameters counted on the meta device)."""
    if cfg.world_size == 1 or KEY in getattr(cfg, "given", ()):
        return None
    from transformers import AutoConfig

    from keel.models.load import check_model_dir, meta_model

    model = cfg.actor_rollout_ref.model
    model_cfg = AutoConfig.from_pretrained(check_model_dir(model.path), trust_remote_code=model.trust_remote_code)
    params = sum(p.numel() for p in meta_model(model_cfg, model.trust_remote_code).parameters())
    return choose_sharding(cfg, model_cfg, params, gpu_bytes(cfg))


def gpu_bytes(cfg: KeelConfig) -> int | None:
    """One GPU's memory where the run's device is a GPU this process sees, else None."""
    if resolve_device(cfg.trainer.device).type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory
