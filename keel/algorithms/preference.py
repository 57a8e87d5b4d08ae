"""Preference losses over sequence log-probs: DPO's family (TRL's names and formulas) and the
Bradley-Terry loss of a reward model.

Each DPO loss takes a pair's summed log-probs under the policy and the reference, and returns the
loss per pair with the implicit rewards TRL logs (`rewards/chosen` is beta times the chosen
completion's log-ratio). The formulas are TRL 1.16's `DPOTrainer._compute_loss` (sigmoid, hinge,
ipo, robust) and `CPOTrainer.cpo_loss` (simpo); tests/unit/test_preference_losses.py runs TRL's
own code on the same seeded log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo")
# Losses with no reference model: SimPO's reward is the policy's own mean log-prob.
REFERENCE_FREE = frozenset({"simpo"})
# Losses that read dpo.label_smoothing; TRL 1.16's sigmoid does not.
SMOOTHED = frozenset({"robust", "simpo"})


@dataclass(frozen=True)
class PairLogProbs:
    """One batch of pairs: summed completion log-probs [B] and completion lengths [B]."""

    chosen: Tensor
    rejected: Tensor
    chosen_tokens: Tensor
    rejected_tokens: Tensor


@dataclass(frozen=True)
class PreferenceLoss:
    # [B] each
    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor


def dpo_loss(
    policy: PairLogProbs,
    reference: PairLogProbs | None,
    loss_type: str,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> PreferenceLoss:
    """The loss of each pair, and the implicit rewards beta * log-ratio (beta * mean log-prob for
    SimPO). `reference` is None only for a reference-free loss."""
    if loss_type == "simpo":
        return _simpo(policy, beta, label_smoothing, simpo_gamma)
    chosen_ratio = policy.chosen - reference.chosen  # [B]
    rejected_ratio = policy.rejected - reference.rejected  # [B]
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        # per-token log-ratios, so beta means the same at any completion length (TRL's choice,
        # agreed with the IPO authors)
        mean_delta = chosen_ratio / policy.chosen_tokens.clamp(min=1) - (
            rejected_ratio / policy.rejected_tokens.clamp(min=1)
        )
        losses = (mean_delta - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        eps = label_smoothing
        losses = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (
            1 - 2 * eps
        )
    else:
        raise ValueError(f"unknown DPO loss {loss_type!r}; one of {LOSS_TYPES}")
    return PreferenceLoss(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def _simpo(
    policy: PairLogProbs, beta: float, label_smoothing: float, gamma: float
) -> PreferenceLoss:
    """SimPO: the margin of length-normalised log-probs, less gamma / beta; no reference."""
    chosen = policy.chosen / policy.chosen_tokens.clamp(min=1)
    rejected = policy.rejected / policy.rejected_tokens.clamp(min=1)
    logits = chosen - rejected - gamma / beta
    losses = (
        -F.logsigmoid(beta * logits) * (1 - label_smoothing)
        - F.logsigmoid(-beta * logits) * label_smoothing
    )
    return PreferenceLoss(losses, beta * chosen.detach(), beta * rejected.detach())


def bradley_terry_loss(
    chosen_scores: Tensor,
    rejected_scores: Tensor,
    margin: Tensor | None = None,
    center_coefficient: float = 0.0,
) -> Tensor:
    """A reward model's loss per pair [B]: -log sigmoid(r_chosen - r_rejected - margin), plus
    center_coefficient * (r_chosen + r_rejected)^2, which keeps rewards near zero (TRL's
    `center_rewards_coefficient`). Its mean is TRL RewardTrainer's loss."""
    difference = chosen_scores - rejected_scores
    if margin is not None:
        difference = difference - margin
    losses = -F.logsigmoid(difference)
    if center_coefficient:
        losses = losses + center_coefficient * (chosen_scores + rejected_scores) ** 2
    return losses


def chosen_nll(policy: PairLogProbs) -> Tensor:
    """The SFT term on chosen completions: their negative log-likelihood per token, over the whole
    batch (TRL's `sft` loss type, added with its weight)."""
    return -policy.chosen.sum() / policy.chosen_tokens.sum().clamp(min=1)
