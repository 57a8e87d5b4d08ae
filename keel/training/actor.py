"""The policy's trainer: old log-probs before the update, then PPO-style mini-batch updates."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from keel.algorithms.distill import generalized_jsd
from keel.algorithms.kl import kl_penalty
from keel.algorithms.losses import PolicyLossParams, agg_loss, compute_policy_loss
from keel.algorithms.rollout_correction import compute_correction
from keel.algorithms.utils import masked_mean
from keel.config.algorithm import RolloutCorrectionConfig
from keel.errors import NO_GRADIENT, KeelError
from keel.training.batching import MicroBatching, MiniBatch, cut_ahead
from keel.training.forward import batched_log_probs, compute_device, response_vocab_stats
from keel.training.optim import build_optimizer, build_scheduler
from keel.training.placement import SINGLE, Placement
from keel.training.step import DeviceTotals, LossScale, apply_gradients, backward, update_role
from keel.types import TrainBatch


def check_gradient_flows(grad_norm: float, mini: MiniBatch) -> None:
    """The first mini-batch is on-policy (ratio 1, nothing clipped): non-zero advantages must give a
    non-zero gradient, or the loss is cut from the weights (a frozen module, a detached tensor, a
    sharding bug) and the run would move its loss and learn nothing."""
    if grad_norm == 0.0 and mini.on_policy_signal:
        raise KeelError(
            NO_GRADIENT,
            "the actor's gradient norm is exactly 0 although advantages are not: "
            "the policy loss does not reach the weights",
        )


@dataclass(frozen=True)
class GKDLoss:
    """distillation.mode=gkd: the generalised JSD to the teacher's top-k, added to the loss."""

    beta: float
    coef: float


@dataclass(slots=True, kw_only=True, frozen=True)
class MicroLoss:
    """One micro-batch's share of the actor's loss, on the device."""

    # what is back-propagated: the policy loss with the entropy and KL terms
    loss: torch.Tensor
    # its policy-loss part: the micro-batches' add up to the mini-batch's
    pg_loss: torch.Tensor
    # per-token means over the micro-batch, weighted by its share of the tokens when summed
    metrics: dict[str, torch.Tensor]


class ActorTrainer:
    def __init__(
        self,
        model,
        actor_cfg,
        temperature: float,
        total_steps: int,
        log_prob_batching: MicroBatching,
        max_response_length: int,
        placement: Placement = SINGLE,
        rollout_correction: RolloutCorrectionConfig | None = None,
        gkd: GKDLoss | None = None,
    ):
        self.model = model
        self.gkd = gkd
        self.placement = placement
        self.cfg = actor_cfg
        # Log-probs are recomputed at the sampling temperature, as verl does, so the PPO ratio
        # compares the same distribution the samples came from.
        self.temperature = temperature
        self.log_prob_batching = log_prob_batching
        self.update_batching = MicroBatching.of(
            actor_cfg.ppo_micro_batch_size_per_gpu,
            actor_cfg.use_dynamic_bsz,
            actor_cfg.ppo_max_token_len_per_gpu,
        )
        self.loss_params = PolicyLossParams(
            clip_ratio_low=actor_cfg.clip_ratio_low or actor_cfg.clip_ratio,
            clip_ratio_high=actor_cfg.clip_ratio_high or actor_cfg.clip_ratio,
            clip_ratio_c=actor_cfg.clip_ratio_c,
            loss_agg_mode=actor_cfg.loss_agg_mode,
            norm_length=max_response_length,
        )
        # verl's bypass mode: the old policy is the sampler's (the trainer set old_log_probs to its
        # log-probs), and weights and rejection follow the policy as it is now, micro-batch by
        # micro-batch.
        bypass = rollout_correction is not None and rollout_correction.bypass_mode
        self.bypass = rollout_correction.params() if bypass else None
        # -A log pi, weighted
        self.reinforce = bypass and rollout_correction.loss_type == "reinforce"
        self.optimizer = build_optimizer(
            model.parameters(), actor_cfg.optim, placement.optimizer_offload
        )
        self.scheduler = build_scheduler(self.optimizer, actor_cfg.optim, total_steps)

    def compute_log_probs(self, batch: TrainBatch) -> torch.Tensor:  # [N, R]
        return batched_log_probs(
            self.model, batch, self.log_prob_batching, self.temperature, self.placement
        )

    def update(self, minis: list[MiniBatch]) -> dict[str, float]:
        return update_role("actor", self.model, self.scheduler, minis, self._update_mini_batch)

    def _update_mini_batch(self, mini: MiniBatch, upcoming: MiniBatch | None) -> dict[str, float]:
        scale = mini.scale
        totals, tokens = DeviceTotals(), float(scale.tokens)
        for _, micro in mini.micro_batches(self.update_batching):
            micro_loss = self._micro_loss(
                micro, scale, measure_gaps=self._measures_gaps(micro, mini)
            )
            backward(micro_loss.loss, "actor", self.placement.data_parallel_size)
            # micro-batch losses add up to the mini-batch loss
            totals.add("actor/pg_loss", micro_loss.pg_loss)
            # token-weighted means
            share = float(micro.loss_mask.sum()) / tokens
            for name, value in micro_loss.metrics.items():
                totals.add(name, value, share)
        metrics = apply_gradients(
            self.model,
            self.optimizer,
            self.cfg.grad_clip,
            "actor",
            self.placement.reduce_gradients,
            totals,
            while_waiting=cut_ahead(upcoming, self.update_batching),
        )
        # bypass's filters may drop every token here
        if self.bypass is None or not self.bypass.rejection:
            check_gradient_flows(metrics["actor/grad_norm"], mini)
        return metrics

    def _measures_gaps(self, micro: TrainBatch, mini: MiniBatch) -> bool:
        """Whether this forward is where the engine's gap is measured: on-policy (the trainer
        skipped the old-log-prob pass), or bypass mode's first mini-batch (the policy is still the
        sampler's)."""
        return micro.old_log_probs is None or (self.bypass is not None and mini.first)

    def _bypass_weights(
        self, log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """Bypass mode's weights on the policy loss, against the policy as it is now: reinforce's
        truncated IS weights, times 0 where a filter rejects. Rejected tokens leave the policy loss
        only, as in verl's bypass mode, and stay in its denominators and in the metrics' means."""
        correction = compute_correction(log_prob, rollout_log_prob, mask, self.bypass)
        weights = correction.weights if self.reinforce else None
        if self.bypass.rejection:
            weights = correction.keep if weights is None else weights * correction.keep
        return weights, correction.metrics

    @staticmethod
    def _old_log_probs(micro: TrainBatch, log_prob: torch.Tensor) -> torch.Tensor:
        """The batch's old log-probs, or where the trainer skipped their pass (on-policy, or the
        first mini-batch's samples) this forward's own, detached: the same policy, so the ratio is 1
        exactly."""
        if micro.old_log_probs is None:
            return log_prob.detach()
        if micro.own_old_log_probs is None:
            return micro.old_log_probs
        return torch.where(micro.own_old_log_probs[:, None], log_prob.detach(), micro.old_log_probs)

    @staticmethod
    def _policy_gaps(
        micro: TrainBatch, log_prob: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """rollout/log_prob_gap (the engine against the trainer) and actor/ref_kl, from the old
        policy's log-probs: token means, which add up over micro-batches and ranks as shares."""
        gaps = {
            "rollout/log_prob_gap": masked_mean((micro.sampling_log_probs - log_prob).abs(), mask)
        }
        if micro.ref_log_probs is not None:
            gaps["actor/ref_kl"] = masked_mean(log_prob - micro.ref_log_probs, mask)
        return gaps

    def _micro_loss(self, micro: TrainBatch, scale: LossScale, measure_gaps: bool) -> MicroLoss:
        """One micro-batch's loss, its policy-loss part and per-token metrics, on the device."""
        cfg = self.cfg
        # once, without waiting for the GPU
        host_micro, micro = micro, micro.to(compute_device(self.model, self.placement))
        mask = micro.loss_mask  # [b, R]
        log_prob, entropy, student_top = response_vocab_stats(
            self.model,
            micro,
            self.temperature,
            with_entropy=True,
            entropy_grad=cfg.entropy_coeff > 0,
            plan=self.placement,
            # gkd: the student's log-probs of the teacher's top-k tokens
            vocab_extra=micro.teacher_top_ids if self.gkd is not None else None,
            host_batch=host_micro,
        )
        old_log_prob = self._old_log_probs(micro, log_prob)
        is_weights = micro.rollout_is_weights
        metrics = {}
        if self.bypass is not None:
            is_weights, correction_metrics = self._bypass_weights(
                log_prob.detach(), old_log_prob, mask
            )
            metrics.update(correction_metrics)
        pg_loss, pg_metrics = compute_policy_loss(
            "gpg" if self.reinforce else cfg.policy_loss.loss_mode,
            old_log_prob,
            log_prob,
            micro.advantages,
            mask,
            self.loss_params,
            **scale.policy_kwargs(),
            is_weights=is_weights,
        )
        loss = pg_loss
        metrics.update({f"actor/{k}": v for k, v in pg_metrics.items()})
        metrics["actor/entropy"] = masked_mean(entropy.detach(), mask)
        # what the old-log-prob pass would have measured
        if measure_gaps:
            metrics.update(self._policy_gaps(micro, log_prob.detach(), mask))
        # entropy and KL terms aggregate like the policy loss
        if cfg.entropy_coeff > 0:
            loss = loss - cfg.entropy_coeff * agg_loss(
                entropy, mask, cfg.loss_agg_mode, **scale.agg_kwargs()
            )
        if cfg.use_kl_loss:
            kl = kl_penalty(log_prob, micro.ref_log_probs, cfg.kl_loss_type)  # [b, R]
            loss = loss + cfg.kl_loss_coef * agg_loss(
                kl, mask, cfg.loss_agg_mode, **scale.agg_kwargs()
            )
            metrics["actor/kl_loss"] = masked_mean(kl.detach(), mask)
        if self.gkd is not None:
            jsd = generalized_jsd(student_top[0], micro.teacher_top_log_probs, self.gkd.beta)
            loss = loss + self.gkd.coef * agg_loss(
                jsd, mask, cfg.loss_agg_mode, **scale.agg_kwargs()
            )
            metrics["distill/gkd_loss"] = masked_mean(jsd.detach(), mask)
        return MicroLoss(loss=loss, pg_loss=pg_loss, metrics=metrics)
