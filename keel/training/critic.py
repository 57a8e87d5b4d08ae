"""The critic's trainer: values before the update, then clipped value-loss updates."""

from __future__ import annotations

import torch

from keel.algorithms.losses import compute_value_loss
from keel.algorithms.utils import masked_mean
from keel.training.batching import MicroBatching, MiniBatch, cut_ahead
from keel.training.forward import compute_device, per_token_outputs, response_values
from keel.training.optim import build_optimizer, build_scheduler
from keel.training.placement import SINGLE, Placement
from keel.training.step import DeviceTotals, apply_gradients, backward, update_role
from keel.types import TrainBatch


class CriticTrainer:
    def __init__(
        self, critic, critic_cfg, micro_size: int, total_steps: int, placement: Placement = SINGLE
    ):
        self.model = critic
        self.placement = placement
        self.cfg = critic_cfg
        self.batching = MicroBatching.of(
            micro_size, critic_cfg.use_dynamic_bsz, critic_cfg.ppo_max_token_len_per_gpu
        )
        self.optimizer = build_optimizer(
            critic.parameters(), critic_cfg.optim, placement.optimizer_offload
        )
        self.scheduler = build_scheduler(self.optimizer, critic_cfg.optim, total_steps)

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch) -> torch.Tensor:  # [N, R]
        self.model.eval()
        return per_token_outputs(
            batch, self.batching, lambda micro: response_values(self.model, micro, self.placement)
        )

    def update(self, minis: list[MiniBatch]) -> dict[str, float]:
        return update_role("critic", self.model, self.scheduler, minis, self._update_mini_batch)

    def _update_mini_batch(self, mini: MiniBatch, upcoming: MiniBatch | None) -> dict[str, float]:
        device = compute_device(self.model, self.placement)
        scale = mini.scale
        totals, tokens = DeviceTotals(), float(scale.tokens)
        for _, host_micro in mini.micro_batches(self.batching):
            # once, without waiting for the GPU
            micro = host_micro.to(device)
            mask = micro.loss_mask
            vpreds = response_values(self.model, micro, self.placement)  # [b, R]
            vf_loss, clipfrac = compute_value_loss(
                vpreds,
                micro.returns,
                micro.values,
                mask,
                self.cfg.cliprange_value,
                self.cfg.loss_agg_mode,
                **scale.agg_kwargs(),
            )
            backward(vf_loss, "critic", self.placement.data_parallel_size)
            share = float(host_micro.loss_mask.sum()) / tokens
            totals.add("critic/vf_loss", vf_loss)
            totals.add("critic/vf_clipfrac", clipfrac, share)
            totals.add("critic/vpred_mean", masked_mean(vpreds.detach(), mask), share)
        return apply_gradients(
            self.model,
            self.optimizer,
            self.cfg.grad_clip,
            "critic",
            self.placement.reduce_gradients,
            totals,
            while_waiting=cut_ahead(upcoming, self.batching),
        )
