"""AdamW and the learning-rate schedule, stepped once per RL step as verl does."""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from keel.errors import NO_GRADIENT, KeelError


def build_optimizer(params, optim_cfg) -> torch.optim.Optimizer:
    """AdamW. On GPU the fused kernel: one launch for every parameter, and under FSDP one DTensor
    dispatch instead of one per foreach op (a dozen per step, each costing CPU time per
    parameter). CPU keeps the default kernels, whose rounding the CPU tests compare exactly."""
    params = [p for p in params if p.requires_grad]  # a frozen base (LoRA) carries no optimiser state
    if not params:
        raise KeelError(NO_GRADIENT, "every parameter of the model is frozen: nothing would train",
                        "unfreeze the model (a wrapper that set requires_grad=False), or use LoRA (model.lora_rank)")
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas),
                             weight_decay=optim_cfg.weight_decay, fused=fused or None)


def warmup_steps(optim_cfg, total_steps: int) -> int:
    if optim_cfg.lr_warmup_steps >= 0:
        return optim_cfg.lr_warmup_steps
    return int(optim_cfg.lr_warmup_steps_ratio * total_steps)


def build_scheduler(optimizer, optim_cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then constant or cosine down to `min_lr_ratio`."""
    warmup = warmup_steps(optim_cfg, total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if optim_cfg.warmup_style == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return optim_cfg.min_lr_ratio + (1.0 - optim_cfg.min_lr_ratio) * cosine

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@contextmanager
def optimizer_state_on(optimizer: torch.optim.Optimizer, device: torch.device, offloaded: bool):
    """fsdp_config.optimizer_offload: Adam's two moments wait in CPU memory, away from the KV cache
    and activations, and come to `device` only for the update."""
    if offloaded:
        _move_optimizer_state(optimizer, device)
    try:
        yield
    finally:
        if offloaded:
            _move_optimizer_state(optimizer, torch.device("cpu"))


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
