"""What every optimiser step shares: the loss's denominators, gradient checks, clipping,
stepping."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from keel.errors import NO_GRADIENT, NONFINITE_LOSS, KeelError


@dataclass
class LossScale:
    """The denominators of a mini-batch's loss, so micro-batch losses add up to it exactly."""

    # valid tokens in the mini-batch
    tokens: torch.Tensor
    # sequences with a valid token
    seqs: torch.Tensor
    # seq-mean-token-sum-norm's constant
    norm_length: int | None

    def policy_kwargs(self) -> dict:
        return {"global_tokens": self.tokens, "global_seqs": self.seqs}

    def agg_kwargs(self) -> dict:
        return {**self.policy_kwargs(), "norm_length": self.norm_length}


class DeviceTotals:
    """A mini-batch's metrics summed on the device (in float64) and read back with one host sync at
    its end: an .item() per metric and micro-batch would make the CPU wait for the GPU to drain its
    queue before it could launch the next micro-batch's kernels."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor | float] = {}

    def add(self, name: str, value: torch.Tensor | float, weight: float = 1.0) -> None:
        value = value.detach().double() if torch.is_tensor(value) else float(value)
        self.sums[name] = self.sums.get(name, 0.0) + value * weight

    def floats(self) -> dict[str, float]:
        devices = [v.device for v in self.sums.values() if torch.is_tensor(v)]
        device = devices[0] if devices else torch.device("cpu")
        values = (
            torch.stack(
                [
                    torch.as_tensor(v, dtype=torch.float64, device=device).reshape(())
                    for v in self.sums.values()
                ]
            ).tolist()
            if self.sums
            else []
        )
        return dict(zip(self.sums, values))


def mask_counts(response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid tokens, sequences with a valid token) of a mini-batch: the loss denominators."""
    return response_mask.sum().clamp(min=1), (response_mask.sum(-1) > 0).sum().clamp(min=1)


def backward(loss: torch.Tensor, role: str, data_parallel_size: int = 1) -> None:
    """Back-propagate, refusing a loss that no trainable weight feeds (frozen or detached model).

    Each rank's loss is its share of the whole mini-batch's loss (global denominators), so the
    ranks' gradients must add up; FSDP averages them, hence the multiplication."""
    if not loss.requires_grad:
        raise KeelError(
            NO_GRADIENT,
            f"the {role} loss does not depend on any trainable parameter: every "
            "weight is frozen or the graph was detached before the loss",
        )
    (loss * data_parallel_size if data_parallel_size > 1 else loss).backward()


def apply_gradients(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    grad_clip: float,
    role: str,
    reduce_gradients: Callable[[list[torch.Tensor]], None] | None = None,
    totals: DeviceTotals | None = None,
    while_waiting: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Clip, check and step -> `totals`' metrics and f"{role}/grad_norm", read back with one host
    sync. A non-finite or missing gradient stops the run before it is applied.

    The host waits for the GPU once per optimiser step, where it used to wait three times (the
    metrics, the norm's check, the norm): each wait drains the GPU's queue, which then idles while
    Python launches the next mini-batch. Fused Adam and AdamW step before that read, skipping their
    own update on the device when the norm is not finite (found_inf, as GradScaler does), so the
    weights stay unchanged when the check then refuses the step; others are checked before they
    step. `reduce_gradients`: averages the gradients over ranks that each hold the whole model (DDP,
    fsdp_size=1); FSDP reduces its own. `while_waiting`: host work to do before the sync, while the
    GPU still runs what was launched (the next mini-batch's cut: batching.cut_ahead)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    refuse_missing_gradients(named, role)
    params = [p for _, p in named]
    if reduce_gradients is not None:
        reduce_gradients(params)
    steps_on_device = skips_nonfinite_on_device(optimizer, params)
    if steps_on_device:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        clip_and_step_on_device(optimizer, grad_norm, grad_clip)
    else:
        grad_norm = clip_gradients(params, grad_clip)
    totals = totals or DeviceTotals()
    totals.add(f"{role}/grad_norm", grad_norm)
    if while_waiting is not None:
        while_waiting()
    # the host sync
    metrics = totals.floats()
    if not math.isfinite(metrics[f"{role}/grad_norm"]):
        bad = [name for name, p in named if not torch.isfinite(full_value(p.grad)).all()]
        optimizer.zero_grad(set_to_none=True)
        raise KeelError(
            NONFINITE_LOSS,
            f"{role} gradient norm is {metrics[f'{role}/grad_norm']} (non-finite in "
            f"{len(bad)} parameters, e.g. {bad[:3]}); the update was refused and the weights "
            "are unchanged",
        )
    if not steps_on_device:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # An update's mini-batches run inside one autocast context, which caches each float32 weight's
    # low-precision copy until the context exits: without this, the next mini-batch's eager matmuls
    # (lm_head, LoRA's adapters, uncompiled layers) would use the weights from before this step.
    torch.clear_autocast_cache()
    return metrics


def refuse_missing_gradients(named: list[tuple[str, torch.Tensor]], role: str) -> None:
    """A trainable parameter with no gradient stops the run: the loss does not reach it."""
    missing = [name for name, p in named if p.grad is None]
    if missing:
        raise KeelError(
            NO_GRADIENT,
            f"{len(missing)} of {len(named)} trainable {role} parameters received no "
            f"gradient, e.g. {missing[:3]}",
        )


def skips_nonfinite_on_device(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> bool:
    """Whether the optimiser's step can skip itself on the device (found_inf): torch's fused Adam
    and AdamW leave weights, moments and step count as they were; sharded parameters (DTensors)
    are left to the plain path."""
    return (
        isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
        and bool(optimizer.defaults.get("fused"))
        and not _sharded(params)
    )


def clip_and_step_on_device(
    optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor, grad_clip: float
) -> None:
    """The fused step, which divides each gradient by its grad_scale as it reads it: the clip as
    clip_grads_with_norm_ computes it (a norm above grad_clip brought to it), without a pass of
    its own over every gradient; and found_inf, a non-finite norm, skips the step on the
    device."""
    finite = torch.isfinite(grad_norm)
    optimizer.found_inf = (~finite).float()
    # 1 / clip_grads_with_norm_'s clamped coefficient, grad_clip / (norm + 1e-6)
    divisor = ((grad_norm + 1e-6) / grad_clip).clamp(min=1.0)
    optimizer.grad_scale = torch.where(finite, divisor, 1.0)
    try:
        optimizer.step()
    finally:
        # a later step must not find them
        del optimizer.found_inf, optimizer.grad_scale


def clip_gradients(params: list[torch.Tensor], grad_clip: float) -> torch.Tensor:
    """Scale the gradients to a norm of at most grad_clip -> their norm before. A non-finite norm
    leaves them as they are, so a refused step names the parameters that hold the non-finite
    values (torch's clip_grad_norm_ would multiply every gradient by nan). Sharded (FSDP):
    torch's own, over every rank's shard."""
    if _sharded(params):
        return full_value(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    torch.nn.utils.clip_grads_with_norm_(
        params, grad_clip, torch.where(torch.isfinite(norm), norm, 0.0)
    )
    return norm


def _sharded(params: list[torch.Tensor]) -> bool:
    return any(hasattr(p, "to_local") for p in params)


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a sharded one (a DTensor under FSDP2), unchanged otherwise."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def update_role(
    role: str,
    model: nn.Module,
    scheduler,
    minis: list,
    update_mini_batch: Callable[[object, object | None], dict[str, float]],
) -> dict[str, float]:
    """One RL step's update of a role (actor or critic): an optimiser step per mini-batch, each
    returning its metrics, averaged over the mini-batches; the LR schedule steps once per RL
    step. `update_mini_batch(mini, upcoming)` is told the mini-batch after it (None for the last),
    whose host work it may do while the GPU runs its own."""
    model.train()
    means = MetricMeans()
    for mini, upcoming in zip(minis, [*minis[1:], None]):
        for name, value in update_mini_batch(mini, upcoming).items():
            means.add(name, value)
    means.add(f"{role}/lr", scheduler.get_last_lr()[0])
    scheduler.step()
    return means.means()


class MetricMeans:
    """Averages metrics over mini-batches (each weighted equally, like verl's logs)."""

    def __init__(self):
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def add(self, name: str, value: float) -> None:
        self._sums[name] = self._sums.get(name, 0.0) + float(value)
        self._counts[name] = self._counts.get(name, 0) + 1

    def means(self) -> dict[str, float]:
        return {k: self._sums[k] / self._counts[k] for k in self._sums}
