"""The loss of a micro-batch of pairs, DPO's or a reward model's, as its share of the whole batch's
loss, with the metrics TRL logs summed on the device (read once per step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from keel.algorithms.preference import PairLogProbs, bradley_terry_loss, dpo_loss
from keel.training.preference import PairBatch, pair_log_probs, pair_scores
from keel.training.step import DeviceTotals


@dataclass(frozen=True)
class BatchShare:
    """What a micro-batch's loss is divided by: the whole batch's pairs, and its chosen tokens
    (the SFT term is a per-token mean over the batch)."""

    pairs: int
    chosen_tokens: int


class DPOObjective:
    def __init__(self, dpo_cfg, fused_vocab: bool = False):
        self.cfg = dpo_cfg
        self.fused_vocab = fused_vocab

    def loss(
        self,
        model,
        batch: PairBatch,
        reference: PairLogProbs | None,
        share: BatchShare,
        totals: DeviceTotals,
    ) -> torch.Tensor:
        c = self.cfg
        policy, _ = pair_log_probs(model, batch, self.fused_vocab)
        if reference is not None:
            reference = _on(reference, policy.chosen.device)
        out = dpo_loss(policy, reference, c.loss_type, c.beta, c.label_smoothing, c.simpo_gamma)
        loss = out.losses.sum() / share.pairs
        totals.add("train/dpo_loss", loss)
        if c.sft_weight:
            nll = -policy.chosen.sum() / share.chosen_tokens
            totals.add("train/sft_loss", nll)
            loss = loss + c.sft_weight * nll
        totals.add("train/loss", loss)
        _add_pair_metrics(totals, out.chosen_rewards, out.rejected_rewards, share.pairs)
        totals.add("logps/chosen", policy.chosen.sum() / share.pairs)
        totals.add("logps/rejected", policy.rejected.sum() / share.pairs)
        return loss


class RewardObjective:
    """Bradley-Terry on a sequence classifier's scores; the rewards metrics are its scores."""

    def __init__(self, center_coefficient: float):
        self.center_coefficient = center_coefficient

    def loss(
        self,
        model,
        batch: PairBatch,
        reference: PairLogProbs | None,
        share: BatchShare,
        totals: DeviceTotals,
    ) -> torch.Tensor:
        chosen, rejected = pair_scores(model, batch)
        margins = batch.margins.to(chosen.device) if batch.margins is not None else None
        losses = bradley_terry_loss(chosen, rejected, margins, self.center_coefficient)
        loss = losses.sum() / share.pairs
        totals.add("train/loss", loss)
        _add_pair_metrics(totals, chosen.detach(), rejected.detach(), share.pairs)
        return loss


def _add_pair_metrics(
    totals: DeviceTotals, chosen: torch.Tensor, rejected: torch.Tensor, pairs: int
) -> None:
    """TRL's names: the mean chosen and rejected rewards, their margin, and the share of pairs
    ranked right."""
    totals.add("rewards/chosen", chosen.sum() / pairs)
    totals.add("rewards/rejected", rejected.sum() / pairs)
    totals.add("rewards/margins", (chosen - rejected).sum() / pairs)
    totals.add("rewards/accuracies", (chosen > rejected).float().sum() / pairs)


def _on(log_probs: PairLogProbs, device: torch.device) -> PairLogProbs:
    return PairLogProbs(*(t.to(device) for t in vars(log_probs).values()))
