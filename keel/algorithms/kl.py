"""KL penalties against the reference policy, and the controllers that set their coefficient.

Estimators follow Schulman's "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html):
with samples from the policy, k1 = log p - log q is unbiased but noisy, k2 = (log p - log q)^2 / 2
and k3 = q/p - 1 - log(q/p) are low-variance (k3 unbiased and always >= 0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .utils import masked_mean


def _k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


def _abs(log_ratio: Tensor) -> Tensor:
    return log_ratio.abs()


def _k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: Tensor) -> Tensor:
    # Clamps as verl: exp(20) stays finite, and the clamp to [-10, 10] bounds the damage of a
    # token whose policy has drifted far from the reference.
    # log(ref / policy)
    kl = torch.clamp(-log_ratio, -20.0, 20.0)
    return torch.clamp(torch.exp(kl) - kl - 1, -10.0, 10.0)


_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "kl": _k1,
    "abs": _abs,
    "mse": _k2,
    "low_var_kl": _k3,
}
_ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}
KL_ESTIMATORS = (*_ESTIMATORS, *_ALIASES)


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate of the policy from the reference: [B, T], [B, T] -> [B, T]."""
    name = _ALIASES.get(kind, kind)
    if name not in _ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; valid: {list(KL_ESTIMATORS)}")
    return _ESTIMATORS[name](log_prob - ref_log_prob)


class FixedKLController:
    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """A fixed coefficient ignores the measured KL."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = state["value"]


class AdaptiveKLController:
    """Proportional controller steering the measured KL towards `target_kl` (arXiv 1909.08593).

    The error is clipped to +-20% so one outlier batch cannot swing the coefficient; `horizon`
    is how many samples it takes for the coefficient to move by that error.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL needs target_kl > 0 and horizon > 0, got {target_kl}, {horizon}"
            )
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        # Target and horizon come from the config; only the coefficient evolves during training.
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = state["value"]


KLController = FixedKLController | AdaptiveKLController


def make_kl_controller(
    kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000
) -> KLController:
    """Defaults for `target_kl` and `horizon` are verl's (`algorithm.kl_ctrl`)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; valid: ['fixed', 'adaptive']")


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: Tensor,  # [B, T]
    log_prob: Tensor,  # [B, T] policy at rollout time
    ref_log_prob: Tensor,  # [B, T]
    response_mask: Tensor,  # [B, T]
    kl_coef: float,
    kind: str,
) -> tuple[Tensor, float]:
    """KL-in-reward (InstructGPT style): returns (token_level_rewards [B, T], current_kl).

    `current_kl` is the batch mean of each sequence's mean token KL, the quantity the adaptive
    controller is tuned on; the caller passes it to `controller.update`.
    """
    kl = kl_penalty(log_prob, ref_log_prob, kind) * response_mask  # [B, T]
    rewards = token_level_scores - kl_coef * kl
    current_kl = masked_mean(kl, response_mask, dim=-1).mean().item()
    return rewards, current_kl
