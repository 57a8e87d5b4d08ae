"""The training batch: the step's passes over its scored samples (old and reference log-probs,
values), the learning signal (rewards per token, rollout correction, advantages), and the
TrainBatch built once from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from keel.algorithms.advantages import AdvantageInputs, AdvantageParams, compute_advantage
from keel.algorithms.distill import distill_metrics, reverse_kl_advantages
from keel.algorithms.kl import apply_kl_penalty
from keel.algorithms.rollout_correction import compute_correction
from keel.algorithms.utils import masked_mean
from keel.config.schema import KeelConfig
from keel.observe.guards import check_finite, check_log_prob_gap
from keel.observe.metrics import Timer
from keel.trainer.seeds import step_seed
from keel.trainer.setup import Components
from keel.trainer.versions import sampled_by
from keel.training.teacher import TeacherScores
from keel.types import OldLogProbSource, SamplingParams, ScoredBatch, TrainBatch


@dataclass(slots=True, kw_only=True, frozen=True)
class StepState:
    """Where a step stands while its passes run."""

    # the step, from 1
    step: int
    # the policy version the step's update starts from
    updating: int
    # past algorithm.critic_warmup: the step updates the actor
    updates_actor: bool
    timer: Timer
    # the step's metrics, which the passes add to
    metrics: dict[str, float]


@dataclass(slots=True, kw_only=True, frozen=True)
class OldLogProbs:
    """The update's old log-probs, as the step's old-log-prob pass left them."""

    # [N, R]; None: the update's own forward gives every one (on-policy)
    values: Tensor | None
    # [N] bool: the samples whose old log-probs are the update's own forward (0 in `values`);
    # None: `values` holds every sample's
    own: Tensor | None
    # the update's forward measures the engine's gap (and the reference KL): no pass did
    measured_in_update: bool


class TrainBatchBuilder:
    """Builds a step's TrainBatch from its ScoredBatch, checking each pass for non-finite values."""

    def __init__(self, cfg: KeelConfig, components: Components, sampling: SamplingParams):
        self.cfg, self.components, self.sampling = cfg, components, sampling
        # the rollout correction the run applies: the plan's (async mode may turn it on)
        self.correction = components.plan.rollout_correction
        a = cfg.algorithm
        self.adv_params = AdvantageParams(
            gamma=a.gamma, lam=a.lam, norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo
        )

    def old_log_probs(self, scored: ScoredBatch, at: StepState) -> OldLogProbs:
        """On-policy (one mini-batch, one epoch: its forward, detached, is the old policy's; the
        pass is saved), bypass mode (the sampler's log-probs are the old ones), or the pass. With
        several mini-batches and one epoch the pass skips the first mini-batch's samples (their
        forward comes before any optimiser step) and measures the gap on the rest."""
        workers, source = self.components.workers, self.components.plan.old_log_probs
        # the sampler's log-probs enter the loss
        if self.correction.bypass_mode or self.correction.decoupled:
            self._finite("sampler log-probs", scored.sampling_log_probs, scored.response_mask)
        # verl's bypass mode: the sampler's policy is the old one
        if source is OldLogProbSource.SAMPLER:
            return OldLogProbs(values=scored.sampling_log_probs, own=None, measured_in_update=True)
        own = None
        # the first mini-batch's own forward (all of it, or a part); the data's responses (gkd's
        # off-policy steps) take the pass: the teacher's metrics need the student's log-probs
        # before the update, and the samples' own are no sampler's
        if at.updates_actor and source is not OldLogProbSource.RECOMPUTED and scored.sampled:
            own = workers.first_mini_batch(scored, step_seed(self.cfg, at.step))
            # on-policy: the update's forward is every old log-prob
            if own is not None and bool(own.all()):
                return OldLogProbs(values=None, own=None, measured_in_update=True)
        metrics = at.metrics
        with at.timer("old_log_prob"):
            old, metrics["perf/old_log_prob_samples"] = self._recomputed_log_probs(scored, own)
            recomputed = recomputed_mask(scored, own)
            self._finite("actor log-probs", old, recomputed)
            # How far the sampler's log-probs are from the trainer's: numerics, not learning. The
            # data's responses have no sampler, so no gap.
            if scored.sampled:
                metrics["rollout/log_prob_gap"] = masked_mean(
                    (scored.sampling_log_probs - old).abs(), recomputed
                ).item()
                self.check_log_prob_gap(metrics["rollout/log_prob_gap"], scored, at)
        return OldLogProbs(values=old, own=own, measured_in_update=False)

    def train_batch(self, scored: ScoredBatch, old: OldLogProbs, at: StepState) -> TrainBatch:
        """The reference log-probs and values, then the learning signal, and the batch."""
        workers, timer = self.components.workers, at.timer
        ref = values = None
        if self.cfg.ref_enabled:
            with timer("ref"):
                ref = workers.ref_log_probs(scored)
                self._finite("reference log-probs", ref, scored.response_mask)
                # else the update's forward measures it, with the gap
                if not old.measured_in_update:
                    at.metrics["actor/ref_kl"] = masked_mean(
                        old.values - ref, recomputed_mask(scored, old.own)
                    ).item()
        if self.cfg.critic_enabled:
            with timer("values"):
                values = workers.values(scored)
                self._finite("critic values", values, scored.response_mask)
        teacher = self._teacher_scores(scored, old, at) if self.cfg.teacher_enabled else None
        signal = self._learning_signal(scored, old.values, ref, values, at)
        if teacher is not None:
            signal["advantages"] = self._distilled_advantages(
                signal["advantages"], scored, student_log_probs(scored, old), teacher
            )
            self._finite("advantages", signal["advantages"], scored.response_mask)
        return TrainBatch.of(
            scored,
            old_log_probs=old.values,
            own_old_log_probs=old.own,
            ref_log_probs=ref,
            values=values,
            **({} if teacher is None else teacher.batch_fields()),
            **signal,
        )

    def _teacher_scores(self, scored: ScoredBatch, old: OldLogProbs, at: StepState):
        """The teacher's pass over the samples, and distill/* from it against the student's
        log-probs before the update."""
        with at.timer("teacher"):
            teacher = self.components.workers.teacher_scores(scored)
            self._finite("teacher log-probs", teacher.log_probs, scored.response_mask)
            if teacher.top_log_probs is not None:
                # a [N, R] mask indexes the [N, R, k] log-probs position by position
                self._finite("teacher top-k log-probs", teacher.top_log_probs, scored.response_mask)
        at.metrics.update(
            distill_metrics(student_log_probs(scored, old), teacher.log_probs, scored.response_mask)
        )
        return teacher

    def _distilled_advantages(
        self, task: Tensor, scored: ScoredBatch, student: Tensor, teacher: TeacherScores
    ) -> Tensor:
        """reverse_kl: the task's advantages (weighted by task_reward_coef) plus the teacher's
        per-token judgement; gkd: the task's alone, weighted (the loss holds the teacher)."""
        d = self.cfg.distillation
        # the data's responses (gkd's off-policy steps): no policy gradient, the JSD alone
        task = d.task_reward_coef * task if scored.sampled else torch.zeros_like(task)
        if d.mode != "reverse_kl":
            return task
        return task + reverse_kl_advantages(
            student, teacher.log_probs, scored.response_mask, d.coef, d.kl_estimator
        )

    def check_log_prob_gap(self, gap: float, batch: ScoredBatch, at: StepState) -> None:
        # Greedy engines record log-probs at temperature 1, not the trainer's; samples of an older
        # policy (async mode) differ from the trainer's by its updates since, which is no broken
        # weight sync. The data's responses (gkd's off-policy steps) were sampled by no one.
        if (
            batch.sampled
            and self.sampling.do_sample
            and sampled_by(self.components.plan.off_policy, batch, at.updating)
        ):
            check_log_prob_gap(gap, at.step, self.cfg.trainer.guards.max_log_prob_gap)

    def _recomputed_log_probs(
        self, scored: ScoredBatch, own: Tensor | None
    ) -> tuple[Tensor, float]:
        """The old-log-prob pass [N, R] over the samples whose old log-probs are not the update's
        own (`own`; 0 for those), and how many samples it computed."""
        if own is None:
            return self.components.workers.actor_log_probs(scored), float(len(scored))
        rows = (~own).nonzero().squeeze(-1)
        old = torch.zeros(scored.response_mask.shape)
        # some: on-policy returned earlier
        old[rows] = self.components.workers.actor_log_probs(scored.select(rows))
        return old, float(len(rows))

    def _learning_signal(
        self, scored: ScoredBatch, old, ref, values, at: StepState
    ) -> dict[str, Tensor | None]:
        """Token-level rewards, rollout correction (decoupled mode), advantages and returns
        (ReMax's baselines came with the scored batch)."""
        with at.timer("adv"):
            rewards = self._token_rewards(scored, old, ref, at.metrics)
            self._finite("token-level rewards", rewards, scored.response_mask)
            # the data's responses (gkd's off-policy steps) have no sampler to correct for
            decoupled = self.correction.decoupled and scored.sampled
            correction = self._correct_rollout(scored, old, at.metrics) if decoupled else {}
            advantages, returns = self._task_advantages(scored, rewards, values)
            self._finite("advantages", advantages, scored.response_mask)
        return {
            "token_level_rewards": rewards,
            "advantages": advantages,
            "returns": returns,
            **correction,
        }

    def _task_advantages(self, scored: ScoredBatch, rewards: Tensor, values) -> tuple:
        """The estimator's advantages and returns [N, R] from the rewards; zeros where the
        rewards teach nothing (distillation with task_reward_coef=0: no critic was built)."""
        if not self.cfg.rewards_teach:
            return torch.zeros_like(rewards), torch.zeros_like(rewards)
        return compute_advantage(
            self.cfg.algorithm.adv_estimator,
            AdvantageInputs(
                rewards, scored.response_mask, scored.group_index, values, scored.baselines
            ),
            self.adv_params,
            None if scored.sample_index is None else scored.final_segments,
        )

    def _token_rewards(
        self, scored: ScoredBatch, old: Tensor | None, ref: Tensor | None, metrics: dict
    ) -> Tensor:
        """[N, R] the outcome score (normalised, if asked) on each response's last token; optionally
        minus KL to the reference."""
        rewards, normalizer_metrics = outcome_rewards(scored, self.components.normalizer)
        metrics.update(normalizer_metrics)
        if not self.cfg.algorithm.use_kl_in_reward:
            return rewards
        kl_coef = self.components.kl_ctrl.value
        rewards, current_kl = apply_kl_penalty(
            rewards, old, ref, scored.response_mask, kl_coef, self.cfg.algorithm.kl_penalty
        )
        self.components.kl_ctrl.update(current_kl, len(scored))
        metrics["actor/reward_kl_penalty"] = current_kl
        metrics["actor/reward_kl_penalty_coeff"] = kl_coef
        return rewards

    def _correct_rollout(self, scored: ScoredBatch, old: Tensor, metrics: dict) -> dict:
        """Decoupled rollout correction, once per batch: the old policy's log-probs against the
        sampler's give the policy loss its IS weights and rejection its mask."""
        correction = compute_correction(
            old, scored.sampling_log_probs, scored.response_mask, self.correction.params()
        )
        metrics.update({name: value.item() for name, value in correction.metrics.items()})
        keep = correction.keep if self.correction.rollout_rs else None
        return {"rollout_is_weights": correction.weights, "rollout_keep": keep}

    def _finite(self, name: str, values: Tensor, mask: Tensor) -> None:
        check_finite(name, values, mask, policy=self.cfg.trainer.guards.nonfinite)


def outcome_rewards(batch: ScoredBatch, normalizer) -> tuple[Tensor, dict[str, float]]:
    """[N, R] each sample's outcome score (normalised, if asked; plus what a multi-turn episode's
    tools and interactions gave) on its response's last token, and the normaliser's metrics."""
    metrics = {}
    outcome = batch.scores  # [N]
    if normalizer is not None:
        outcome, metrics = normalizer(batch.scores)
    if batch.turn_rewards is not None:
        outcome = outcome + batch.turn_rewards
    scores = torch.zeros_like(batch.response_mask, dtype=torch.float32)  # [N, R]
    scores[torch.arange(len(batch)), batch.last_token_index] = outcome
    return scores * batch.response_mask, metrics


def student_log_probs(batch: ScoredBatch, old: OldLogProbs) -> Tensor:  # [N, R]
    """The student's log-probs of its sampled tokens before the update: the old-log-prob pass's,
    or the sampler's where the update's own forward stands in for that pass (on-policy: the
    advantages must exist before that forward runs)."""
    if old.values is None:
        return batch.sampling_log_probs
    if old.own is None:
        return old.values
    return torch.where(old.own[:, None], batch.sampling_log_probs, old.values)


def recomputed_mask(batch: ScoredBatch, own: Tensor | None) -> Tensor:  # [N, R]
    """The response tokens whose old log-probs the pass computed (all but `own`'s samples): where
    the trainer measures the engine's gap and the reference KL (a sample of the batch when the first
    mini-batch is skipped)."""
    if own is None:
        return batch.response_mask
    return batch.response_mask * (~own)[:, None]
