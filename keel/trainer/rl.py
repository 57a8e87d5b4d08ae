"""The RL loop: generate, score, compute log-probs and values, advantages, update, repeat.

One process drives the algorithm; the components it calls (rollout engine, actor, critic) are the
ones worker groups will wrap when keel runs on many GPUs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from keel import checkpoint as ckpt
from keel.algorithms.advantages import AdvantageInputs, AdvantageParams, compute_advantage
from keel.algorithms.kl import apply_kl_penalty
from keel.algorithms.rollout_correction import compute_correction
from keel.algorithms.utils import masked_mean
from keel.config.plan import Plan, make_plan
from keel.config.schema import GROUP_ESTIMATORS, KeelConfig
from keel.observe.batch_metrics import batch_metrics, throughput_metrics
from keel.observe.guards import (
    LearningSignalGuard,
    SkipStep,
    check_finite,
    check_log_prob_gap,
    frac_reward_zero_std,
    report_warnings,
)
from keel.observe.log import warnings_said_once
from keel.observe.metrics import MetricsLogger, Timer, last_logged_metrics
from keel.rollout.agent.metrics import agent_metrics
from keel.trainer.ahead import step_rollout
from keel.trainer.evaluate import Validation
from keel.trainer.hooks import load_hook, run_hooks
from keel.trainer.run_directory import RunDirectory
from keel.trainer.scored_rollout import ScoredRollout, training_sampling
from keel.trainer.seeds import step_seed
from keel.trainer.setup import Components, Inputs, build_components
from keel.trainer.versions import sampled_by
from keel.types import RolloutBatch, ScoredBatch

log = logging.getLogger("keel")


@dataclass
class RunResult:
    run_dir: Path
    last_step: int
    last_metrics: dict[str, float]


class RLTrainer:
    def __init__(
        self,
        cfg: KeelConfig,
        inputs: Inputs | None = None,
        check_report: str | None = None,
        plan: Plan | None = None,
    ):
        """`check_report`: `keel check`'s whole report on this config, kept in the run directory.
        `plan`: keel's decisions for the config (`load_run`'s); None: the config's own, as written."""
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.resume_from = ckpt.resume_point(self.run_dir, cfg)
        self.hooks = [load_hook(spec, cfg.trainer.hooks) for spec in cfg.trainer.hooks]
        self.guard = LearningSignalGuard(
            cfg.trainer.guards,
            cfg.algorithm.adv_estimator in GROUP_ESTIMATORS,
            cfg.actor_rollout_ref.rollout.ignore_eos,
        )
        self.skipped_steps = 0
        # kind -> steps that warned of it
        self.warned_steps: dict[str, int] = {}
        start_from = self.resume_from / "actor" if self.resume_from else None
        self.components: Components = build_components(cfg, start_from, inputs, plan)
        self.sampling = training_sampling(cfg)
        self.scored = ScoredRollout(cfg, self.components, self.sampling)
        self.rollout = step_rollout(
            cfg,
            self.components.plan.off_policy,
            self.scored,
            self.components.sampler,
            self.components.total_steps,
        )
        self.run_files = RunDirectory(cfg, self.components, check_report)
        self.validation = Validation(cfg, self.components)
        a = cfg.algorithm
        self.adv_params = AdvantageParams(
            gamma=a.gamma, lam=a.lam, norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo
        )
        self.correction = self.components.plan.rollout_correction
        self.step = 0
        # a resumed run's trainer_state
        self.restored: dict | None = None
        # the policy version the current step's update starts from
        self.updating = 0

    # --- the loop ----------------------------------------------------------------------------
    def fit(self) -> RunResult:
        self._open_run_dir()
        logger = MetricsLogger.for_run(
            self.cfg, self.run_dir, self.components.total_steps, self.step
        )
        metrics: dict[str, float] = {}
        try:
            logger.write(make_plan(self.cfg, self.components.plan).summary())
            logger.write(self.run_files.description())
            with warnings_said_once():
                if (
                    self.step == 0
                    and self.components.val_data
                    and self.cfg.trainer.val_before_train
                ):
                    logger.log(0, self._validate(logger))
                if self.step >= self.components.total_steps:
                    log.info(
                        "the run is already at step %d of %d: nothing to do (raise "
                        "trainer.total_training_steps to continue it)",
                        self.step,
                        self.components.total_steps,
                    )
                    metrics = last_logged_metrics(self.run_dir / "metrics.jsonl", self.step)
                while self.step < self.components.total_steps:
                    self.step += 1
                    metrics = self.guarded_step(logger)
                    if self.validation.due(self.step):
                        metrics.update(self._validate(logger))
                    logger.log(self.step, metrics)
                    if (
                        _due(self.step, self.cfg.trainer.save_freq)
                        or self.step == self.components.total_steps
                    ):
                        self.save()
        finally:
            self.rollout.close()
            logger.close()
            self.components.reward.shutdown()
            self.components.workers.shutdown()
        return RunResult(self.run_dir, self.step, metrics)

    def guarded_step(self, logger: MetricsLogger) -> dict[str, float]:
        """One step, then keel's guards (every step) and the user's hooks (every hook_freq steps).
        A warning that repeats is printed once and counted (`guards/warned_steps/<kind>`)."""
        try:
            metrics, batch = self.train_step(logger)
        # trainer.guards.nonfinite=skip: the step is dropped, counted, never silent
        except SkipStep:
            self.skipped_steps += 1
            return {"guards/skipped_steps": float(self.skipped_steps)}
        warnings = self.guard(self.step, metrics)
        if self.hooks and _due(self.step, self.cfg.trainer.hook_freq):
            warnings += run_hooks(self.hooks, self.step, metrics, batch)
        metrics.update(report_warnings(self.step, warnings, self.warned_steps))
        metrics["guards/skipped_steps"] = float(self.skipped_steps)
        return metrics

    def train_step(self, logger: MetricsLogger) -> tuple[dict[str, float], RolloutBatch]:
        # With Ray workers the group enforces phase_timeout_s itself, collecting every rank's
        # stacks.
        timer = Timer(
            self.cfg.trainer.guards.phase_timeout_s if self.cfg.world_size == 1 else None,
            logger.phase,
        )
        parts, workers = self.components, self.components.workers
        # the policy this step's update starts from
        self.updating = workers.policy_version
        with timer("step"):
            scored, metrics, gen_parts = self.rollout(timer, self.step)
            # verl's count: steps start at 1
            updates_actor = self.step >= self.cfg.algorithm.critic_warmup
            batch, gap_in_update = self._training_batch(scored, metrics, timer, updates_actor)
            if self.cfg.critic_enabled:
                with timer("update_critic"):
                    metrics.update(workers.update_critic(batch, self._seed()))
            if updates_actor:
                with timer("update_actor"):
                    metrics.update(workers.update_actor(batch, self._seed()))
                if gap_in_update:
                    self._check_log_prob_gap(metrics.get("rollout/log_prob_gap", 0.0), batch)
        logger.log_samples(self.step, _logged_samples(batch, self.cfg.trainer.log_samples))
        metrics.update(_step_report(batch, timer, gen_parts, workers, self.cfg.world_size))
        metrics.update(
            {
                "training/global_step": float(self.step),
                "training/epoch": float(parts.sampler.epoch),
                "guards/frac_reward_zero_std": frac_reward_zero_std(
                    batch.scores, batch.group_index
                ),
            }
        )
        return metrics, batch

    def _training_batch(
        self, scored: ScoredBatch, metrics: dict[str, float], timer: Timer, updates_actor: bool
    ) -> tuple[RolloutBatch, bool]:
        """The step's passes over the scored samples, then the training batch, built once from them: old
        and reference log-probs, values, rewards per token, rollout correction, advantages -> (the batch,
        whether the update measures the engine's gap on its own forward)."""
        workers, finite = self.components.workers, self._check_finite
        old, own, gap_in_update = self._old_log_probs(scored, metrics, timer, updates_actor)
        ref = values = None
        if self.cfg.ref_enabled:
            with timer("ref"):
                ref = workers.ref_log_probs(scored)
                finite("reference log-probs", ref, scored.response_mask)
                # else the update's forward measures it, with the gap
                if not gap_in_update:
                    metrics["actor/ref_kl"] = masked_mean(
                        old - ref, recomputed_mask(scored, own)
                    ).item()
        if self.cfg.critic_enabled:
            with timer("values"):
                values = workers.values(scored)
                finite("critic values", values, scored.response_mask)
        learning = self._advantages(scored, timer, old, ref, values, metrics)
        passes = {
            "old_log_probs": old,
            "own_old_log_probs": own,
            "ref_log_probs": ref,
            "values": values,
        }
        return RolloutBatch.of(scored, **passes, **learning), gap_in_update

    # --- pieces of the step --------------------------------------------------------------------
    def _validate(self, logger: MetricsLogger) -> dict[str, float]:
        # the reward function is the validation's alone while it runs
        self.rollout.settle()
        return self.validation(self.step, self._seed(), logger)

    def _old_log_probs(
        self, scored: ScoredBatch, metrics: dict[str, float], timer: Timer, updates_actor: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
        """(the old policy's log-probs on the batch, the samples whose old log-probs are the update's own
        forward, whether the update measures the engine's gap (and the reference KL) on its own forward
        instead): on-policy (one mini-batch, one epoch: its forward, detached, is the old policy's; the
        pass is saved), or bypass mode (the sampler's log-probs are the old ones). With several
        mini-batches and one epoch the pass skips the first mini-batch's samples (their forward comes
        before any optimiser step) and measures the gap on the rest."""
        workers, source = self.components.workers, self.components.plan.old_log_probs
        # the sampler's log-probs enter the loss
        if self.correction.bypass_mode or self.correction.decoupled:
            self._check_finite("sampler log-probs", scored.sampling_log_probs, scored.response_mask)
        # verl's bypass mode: the sampler's policy is the old one
        if source == "sampler":
            return scored.sampling_log_probs, None, True
        own = None
        # the first mini-batch's own forward (all of it, or a part)
        if updates_actor and source != "recomputed":
            own = workers.first_mini_batch(scored, self._seed())
            # on-policy: the update's forward is every old log-prob
            if own is not None and bool(own.all()):
                return None, None, True
        with timer("old_log_prob"):
            old, metrics["perf/old_log_prob_samples"] = self._recomputed_log_probs(scored, own)
            recomputed = recomputed_mask(scored, own)
            self._check_finite("actor log-probs", old, recomputed)
            # How far the sampler's log-probs are from the trainer's: numerics, not learning.
            metrics["rollout/log_prob_gap"] = masked_mean(
                (scored.sampling_log_probs - old).abs(), recomputed
            ).item()
            self._check_log_prob_gap(metrics["rollout/log_prob_gap"], scored)
        return old, own, False

    def _recomputed_log_probs(
        self, scored: ScoredBatch, own: torch.Tensor | None
    ) -> tuple[torch.Tensor, float]:
        """The old-log-prob pass [N, R] over the samples whose old log-probs are not the update's
        own (`own`; 0 for those), and how many samples it computed."""
        if own is None:
            return self.components.workers.actor_log_probs(scored), float(len(scored))
        rows = (~own).nonzero().squeeze(-1)
        old = torch.zeros(scored.response_mask.shape)
        # some: on-policy returned earlier
        old[rows] = self.components.workers.actor_log_probs(scored.select(rows))
        return old, float(len(rows))

    def _check_log_prob_gap(self, gap: float, batch: ScoredBatch) -> None:
        # Greedy engines record log-probs at temperature 1, not the trainer's; samples of an older
        # policy (async mode) differ from the trainer's by its updates since, which is no broken
        # weight sync.
        if self.sampling.do_sample and sampled_by(
            self.components.plan.off_policy, batch, self.updating
        ):
            check_log_prob_gap(gap, self.step, self.cfg.trainer.guards.max_log_prob_gap)

    def _token_rewards(
        self, scored: ScoredBatch, old: torch.Tensor | None, ref: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """[N, R] the outcome score (normalised, if asked) on each response's last token; optionally
        minus KL to the reference."""
        rewards, metrics = outcome_rewards(scored, self.components.normalizer)
        if not self.cfg.algorithm.use_kl_in_reward:
            return rewards, metrics
        kl_coef = self.components.kl_ctrl.value
        rewards, current_kl = apply_kl_penalty(
            rewards, old, ref, scored.response_mask, kl_coef, self.cfg.algorithm.kl_penalty
        )
        self.components.kl_ctrl.update(current_kl, len(scored))
        return rewards, {
            **metrics,
            "actor/reward_kl_penalty": current_kl,
            "actor/reward_kl_penalty_coeff": kl_coef,
        }

    def _advantages(
        self, scored: ScoredBatch, timer: Timer, old, ref, values, metrics: dict[str, float]
    ) -> dict[str, torch.Tensor | None]:
        """The training batch's learning signal: token-level rewards, rollout correction (decoupled
        mode), advantages and returns (ReMax's baselines came with the scored batch)."""
        finite = self._check_finite
        with timer("adv"):
            rewards, reward_metrics = self._token_rewards(scored, old, ref)
            metrics.update(reward_metrics)
            finite("token-level rewards", rewards, scored.response_mask)
            correction = (
                self._correct_rollout(scored, old, metrics) if self.correction.decoupled else {}
            )
            advantages, returns = compute_advantage(
                self.cfg.algorithm.adv_estimator,
                AdvantageInputs(
                    rewards, scored.response_mask, scored.group_index, values, scored.baselines
                ),
                self.adv_params,
                None if scored.sample_index is None else scored.final_segments,
            )
            finite("advantages", advantages, scored.response_mask)
        return {
            "token_level_rewards": rewards,
            "advantages": advantages,
            "returns": returns,
            **correction,
        }

    def _correct_rollout(
        self, scored: ScoredBatch, old: torch.Tensor, metrics: dict[str, float]
    ) -> dict:
        """Decoupled rollout correction, once per batch: the old policy's log-probs against the
        sampler's give the policy loss its IS weights and rejection its mask."""
        correction = compute_correction(
            old, scored.sampling_log_probs, scored.response_mask, self.correction.params()
        )
        metrics.update({name: value.item() for name, value in correction.metrics.items()})
        keep = correction.keep if self.correction.rollout_rs else None
        return {"rollout_is_weights": correction.weights, "rollout_keep": keep}

    def _check_finite(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        check_finite(name, values, mask, policy=self.cfg.trainer.guards.nonfinite)

    def _seed(self) -> int:
        return step_seed(self.cfg, self.step)

    # --- run directory and checkpoints ---------------------------------------------------------
    def _open_run_dir(self) -> None:
        # loaded first: a mismatch must leave the directory as it was
        if self.resume_from is not None:
            self.load(self.resume_from)
            log.info("resumed from %s at step %d", self.resume_from, self.step)
        self.rollout.start_at(self.step, self.restored)
        self.run_files.open(self.step if self.resume_from else None)

    def save(self) -> Path:
        # async: what is in flight is generated again
        sampler_state, in_flight = self.rollout.resume_state()
        counts = {
            "skipped_steps": self.skipped_steps,
            "warned_steps": self.warned_steps,
            **in_flight,
        }
        return self.run_files.save(self.step, counts, sampler_state)

    def load(self, path: Path) -> None:
        """Restore everything but the actor weights, which `build_components` loaded from `path`."""
        state = self.restored = self.run_files.load(path)
        self.step = state["step"]
        self.skipped_steps = state.get("skipped_steps", 0)
        self.warned_steps = state.get("warned_steps", {})


def outcome_rewards(batch: ScoredBatch, normalizer) -> tuple[torch.Tensor, dict[str, float]]:
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


def _due(step: int, freq: int) -> bool:
    return freq > 0 and step % freq == 0


def recomputed_mask(batch: ScoredBatch, own: torch.Tensor | None) -> torch.Tensor:  # [N, R]
    """The response tokens whose old log-probs the pass computed (all but `own`'s samples): where the
    trainer measures the engine's gap and the reference KL (a sample of the batch when the first
    mini-batch is skipped)."""
    if own is None:
        return batch.response_mask
    return batch.response_mask * (~own)[:, None]


def _step_report(
    batch: RolloutBatch, timer: Timer, gen_parts: dict, workers, world_size: int
) -> dict[str, float]:
    """What a step measures beside its losses: the batch's and the agent loop's statistics, each
    phase's time, generation's parts, throughput and memory."""
    return {
        **batch_metrics(batch),
        **agent_metrics(batch.records),
        **timer.metrics(),
        **gen_parts,
        **throughput_metrics(batch, timer.times["step"], world_size),
        **workers.memory_metrics(),
    }


def _logged_samples(batch: RolloutBatch, limit: int) -> list[dict]:
    """The first `limit` samples of a step as samples.jsonl keeps them (`keel report` reads them)."""
    # the score, minus KL when it is in the reward
    rewards = batch.token_level_rewards.sum(-1).tolist()
    extras = batch.reward_extras or [{}] * len(batch)
    return [
        {
            "data_source": r.data_source,
            "prompt": r.prompt_text,
            "response": text,
            "ground_truth": r.ground_truth,
            "score": score,
            "reward": reward,
            **({"reward_extra": e} if e else {}),
            **(
                {"conversation": r.extra_info["conversation"]}
                if "conversation" in r.extra_info
                else {}
            ),
        }
        for r, text, score, reward, e in zip(
            batch.records, batch.response_texts, batch.scores.tolist(), rewards, extras
        )
    ][:limit]
