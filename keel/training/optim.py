"""AdamW and the learning-rate schedule, stepped once per RL step as verl does."""

from __future__ import annotations

import math

import torch

from keel.errors import NO_GRADIENT, KeelError


def build_optimizer(params, optim_cfg, offload: bool = False) -> torch.optim.Optimizer:
    """AdamW. On GPU the fused kernel: one launch for every parameter, and under FSDP one DTensor
    dispatch instead of one per foreach op (a dozen per step, each costing CPU time per
    parameter). CPU keeps the default kernels, whose rounding the CPU tests compare exactly.
    `offload` (fsdp_config.optimizer_offload): the moments live in CPU memory (OffloadedAdamW)."""
    # a frozen base (LoRA) carries no optimiser state
    params = [p for p in params if p.requires_grad]
    if not params:
        raise KeelError(
            NO_GRADIENT,
            "every parameter of the model is frozen: nothing would train",
            "unfreeze the model (a wrapper that set requires_grad=False), or use LoRA "
            "(model.lora_rank)",
        )
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    kind = OffloadedAdamW if offload else torch.optim.AdamW
    return kind(
        params,
        lr=optim_cfg.lr,
        betas=tuple(optim_cfg.betas),
        weight_decay=optim_cfg.weight_decay,
        fused=fused or None,
    )


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


MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
# moments on the device at once during an offloaded step
OFFLOAD_BUCKET_BYTES = 1 << 30


class OffloadedAdamW(torch.optim.AdamW):
    """fsdp_config.optimizer_offload: Adam's moments live in pinned CPU memory and come to the
    parameters' device a bucket at a time inside step(), so the device never holds the whole
    state (a 7B model's is 61 GB): only the weights, their gradients and one bucket's moments.
    Each bucket is an ordinary AdamW step over its parameters, so the arithmetic is AdamW's."""

    def __init__(self, params, bucket_bytes: int = OFFLOAD_BUCKET_BYTES, **kwargs):
        super().__init__(params, **kwargs)
        self.bucket_bytes = bucket_bytes
        # id(param) -> pinned moments, reused every step
        self._host: dict[int, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("OffloadedAdamW.step takes no closure")
        every = [group["params"] for group in self.param_groups]
        try:
            for bucket in self._buckets(every):
                for group, params in zip(self.param_groups, bucket):
                    # AdamW steps what its groups hold
                    group["params"] = params
                self._moments_to_device([p for params in bucket for p in params])
                super().step()
                self._moments_to_host([p for params in bucket for p in params])
        finally:
            for group, params in zip(self.param_groups, every):
                group["params"] = params
        if torch.cuda.is_available():
            # the host copies are complete before anyone reads them
            torch.cuda.current_stream().synchronize()

    def load_state_dict(self, state_dict) -> None:
        # which puts the moments on the parameters' device
        super().load_state_dict(state_dict)
        self._moments_to_host([p for group in self.param_groups for p in group["params"]])

    def _buckets(self, every: list[list[torch.Tensor]]):
        """Per bucket, each group's parameters in it: about bucket_bytes of moments each."""
        bucket, size = [[] for _ in every], 0
        for index, params in enumerate(every):
            for p in params:
                if size and size + 2 * p.nbytes > self.bucket_bytes:
                    yield bucket
                    bucket, size = [[] for _ in every], 0
                bucket[index].append(p)
                size += 2 * p.nbytes
        if size:
            yield bucket

    def _moments_to_device(self, params: list[torch.Tensor]) -> None:
        for p in params:
            state = self.state.get(p, {})
            for key in MOMENTS:
                if key in state:
                    state[key] = state[key].to(p.device, non_blocking=True)

    def _moments_to_host(self, params: list[torch.Tensor]) -> None:
        for p in params:
            state = self.state.get(p, {})
            for key in [k for k in MOMENTS if k in state]:
                value = state[key]
                if value.device.type == "cpu":
                    continue
                # a DTensor (FSDP2): moved whole, not through a pinned buffer
                if hasattr(value, "to_local"):
                    state[key] = value.to("cpu")
                    continue
                host = self._host.setdefault(id(p), {})
                if key not in host:
                    host[key] = torch.empty_like(
                        value, device="cpu", pin_memory=torch.cuda.is_available()
                    )
                state[key] = host[key].copy_(value, non_blocking=True)
