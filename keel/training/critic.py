"""The critic's trainer: values before the update, then clipped value-loss updates."""

from __future__ import annotations

import torch

from keel.algorithms.losses import compute_value_loss
from keel.algorithms.utils import masked_mean
from keel.training.forward import response_values, split_micro
from keel.training.optim import build_optimizer, build_scheduler
from keel.training.step import LossScale, MetricSums, apply_gradients, backward, mask_counts, minibatch_indices
from keel.types import RolloutBatch, pad_responses


class CriticTrainer:
    def __init__(self, critic, critic_cfg, mini_prompts: int, micro_size: int, epochs: int,
                 rollout_n: int, total_steps: int, shuffle: bool, max_response_length: int):
        self.model = critic
        self.cfg = critic_cfg
        self.samples_per_mini = mini_prompts * rollout_n
        self.micro_size = micro_size
        self.epochs = epochs
        self.shuffle = shuffle
        self.max_response_length = max_response_length
        self.optimizer = build_optimizer(critic.parameters(), critic_cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, critic_cfg.optim, total_steps)

    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:          # [N, R]
        self.model.eval()
        width = batch.response_ids.shape[1]
        values = torch.cat([pad_responses(response_values(self.model, m).cpu(), width)
                            for m in split_micro(batch, self.micro_size)])
        return values * batch.response_mask

    def update(self, batch: RolloutBatch, seed: int) -> dict[str, float]:
        self.model.train()
        sums = MetricSums()
        for epoch in range(self.epochs):
            for index in minibatch_indices(len(batch), self.samples_per_mini, self.shuffle,
                                           seed * 1000 + 500 + epoch):
                self._update_mini_batch(batch.select(index), sums)
        sums.add("critic/lr", self.scheduler.get_last_lr()[0])
        self.scheduler.step()
        return sums.means()

    def _update_mini_batch(self, mini: RolloutBatch, sums: MetricSums) -> None:
        device = next(self.model.parameters()).device
        scale = LossScale(*mask_counts(mini.response_mask), self.max_response_length)
        totals = {"critic/vf_loss": 0.0, "critic/vf_clipfrac": 0.0, "critic/vpred_mean": 0.0}
        for micro in split_micro(mini, self.micro_size):
            mask = micro.response_mask.to(device)
            vpreds = response_values(self.model, micro)                         # [b, R]
            vf_loss, clipfrac = compute_value_loss(
                vpreds, micro.returns.to(device), micro.values.to(device), mask,
                self.cfg.cliprange_value, self.cfg.loss_agg_mode, **scale.agg_kwargs())
            backward(vf_loss, "critic")
            share = mask.sum().item() / scale.tokens.item()
            totals["critic/vf_loss"] += vf_loss.item()
            totals["critic/vf_clipfrac"] += float(clipfrac) * share
            totals["critic/vpred_mean"] += masked_mean(vpreds.detach(), mask).item() * share
        totals["critic/grad_norm"] = apply_gradients(self.model, self.optimizer, self.cfg.grad_clip, "critic")
        for name, value in totals.items():
            sums.add(name, value)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
