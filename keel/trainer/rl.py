"""The RL loop: generate, score, compute log-probs and values, advantages, update, repeat.

One process drives the algorithm; the components it calls (rollout engine, actor, critic) are the
ones worker groups will wrap when keel runs on many GPUs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from keel import checkpoint as ckpt
from keel.config.plan import Plan, make_plan, plan_of
from keel.config.schema import GROUP_ESTIMATORS, KeelConfig
from keel.observe.batch_metrics import batch_metrics, throughput_metrics
from keel.observe.guards import (
    LearningSignalGuard,
    SkipStep,
    frac_reward_zero_std,
    report_warnings,
)
from keel.observe.log import warnings_said_once
from keel.observe.metrics import MetricsLogger, Timer, last_logged_metrics
from keel.rollout.agent.metrics import agent_metrics
from keel.trainer.ahead import StepRollout, step_rollout
from keel.trainer.evaluate import Validation
from keel.trainer.hooks import load_hook, run_hooks
from keel.trainer.run_directory import RunDirectory
from keel.trainer.scored_rollout import ScoredRollout, training_sampling
from keel.trainer.seeds import step_seed
from keel.trainer.setup import Components, Inputs, build_components
from keel.trainer.train_batch import StepState, TrainBatchBuilder
from keel.types import TrainBatch

log = logging.getLogger("keel")


@dataclass
class RunResult:
    run_dir: Path
    last_step: int
    last_metrics: dict[str, float]


class RLTrainer:
    """The RL loop: each step takes its scored samples from the trainer.mode's rollout, builds the
    training batch (TrainBatchBuilder), updates the critic and the actor, and reports."""

    def __init__(
        self,
        cfg: KeelConfig,
        inputs: Inputs | None = None,
        check_report: str | None = None,
        plan: Plan | None = None,
    ):
        """`check_report`: `keel check`'s whole report on this config, kept in the run directory.
        `plan`: keel's decisions for the config (`load_run`'s); None: the config's own, as
        written."""
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        # a checkpoint of keel before the plan holds keel's decisions in its config.yaml
        plan = plan or plan_of(cfg)
        self.resume_from = ckpt.resume_point(self.run_dir, cfg, plan.applied(cfg))
        self.hooks = [load_hook(spec, cfg.trainer.hooks) for spec in cfg.trainer.hooks]
        self.guard = LearningSignalGuard(
            cfg.trainer.guards,
            cfg.algorithm.adv_estimator in GROUP_ESTIMATORS,
            cfg.actor_rollout_ref.rollout.ignore_eos,
            rewards_teach=cfg.rewards_teach,
        )
        self.skipped_steps = 0
        # kind -> steps that warned of it
        self.warned_steps: dict[str, int] = {}
        start_from = self.resume_from / "actor" if self.resume_from else None
        self.components: Components = build_components(cfg, start_from, inputs, plan)
        self.sampling = training_sampling(cfg)
        self.scored = ScoredRollout(cfg, self.components, self.sampling)
        # where each step's scored samples come from
        self.rollout: StepRollout = step_rollout(
            cfg,
            self.components.plan.off_policy,
            self.scored,
            self.components.sampler,
            self.components.total_steps,
        )
        self.run_files = RunDirectory(cfg, self.components, check_report)
        self.validation = Validation(cfg, self.components)
        self.batches = TrainBatchBuilder(cfg, self.components, self.sampling)
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

    def train_step(self, logger: MetricsLogger) -> tuple[dict[str, float], TrainBatch]:
        # With Ray workers the group enforces phase_timeout_s itself, collecting every rank's
        # stacks.
        timer = Timer(
            self.cfg.trainer.guards.phase_timeout_s if self.cfg.world_size == 1 else None,
            logger.phase,
        )
        workers, seed = self.components.workers, self._seed()
        # the policy this step's update starts from
        self.updating = workers.policy_version
        with timer("step"):
            samples = self.rollout(timer, self.step)
            at = StepState(
                step=self.step,
                updating=self.updating,
                # verl's count: steps start at 1
                updates_actor=self.step >= self.cfg.algorithm.critic_warmup,
                timer=timer,
                metrics=dict(samples.metrics),
            )
            old = self.batches.old_log_probs(samples.batch, at)
            batch = self.batches.train_batch(samples.batch, old, at)
            metrics = at.metrics
            if self.cfg.critic_enabled:
                with timer("update_critic"):
                    metrics.update(workers.update_critic(batch, seed))
            if at.updates_actor:
                with timer("update_actor"):
                    metrics.update(workers.update_actor(batch, seed))
                if old.measured_in_update:
                    gap = metrics.get("rollout/log_prob_gap", 0.0)
                    self.batches.check_log_prob_gap(gap, batch, at)
        logger.log_samples(self.step, _logged_samples(batch, self.cfg.trainer.log_samples))
        metrics.update(_step_report(batch, timer, samples.timing, workers, self.cfg.world_size))
        metrics.update(
            {
                "training/global_step": float(self.step),
                "training/epoch": float(self.components.sampler.epoch),
                "guards/frac_reward_zero_std": frac_reward_zero_std(
                    batch.scores, batch.group_index
                ),
            }
        )
        return metrics, batch

    # --- pieces of the step --------------------------------------------------------------------
    def _validate(self, logger: MetricsLogger) -> dict[str, float]:
        # the reward function is the validation's alone while it runs
        self.rollout.settle()
        return self.validation(self.step, self._seed(), logger)

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


def _due(step: int, freq: int) -> bool:
    return freq > 0 and step % freq == 0


def _step_report(
    batch: TrainBatch, timer: Timer, generation: dict, workers, world_size: int
) -> dict[str, float]:
    """What a step measures beside its losses: the batch's and the agent loop's statistics, each
    phase's time, generation's parts, throughput and memory."""
    return {
        **batch_metrics(batch),
        **agent_metrics(batch.records),
        **timer.metrics(),
        **generation,
        **throughput_metrics(batch, timer.times["step"], world_size),
        **workers.memory.metrics(),
    }


def _logged_samples(batch: TrainBatch, limit: int) -> list[dict]:
    """The first `limit` samples of a step as samples.jsonl keeps them (`keel report` reads
    them)."""
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
