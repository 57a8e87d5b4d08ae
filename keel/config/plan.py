"""What keel decides after reading the config, and the batch plan that explains it.

`Plan` is every decision, made once after load: the config stays what the user wrote. `BatchPlan`
is what one RL step does, in numbers, printed and saved at start. verl's batch sizes are counted in
prompts for mini-batches and in samples for micro-batches; the batch plan spells out both so nobody
has to multiply by `rollout.n` in their head.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

from keel.config.algorithm import RolloutCorrectionConfig
from keel.config.schema import ActorRolloutRefConfig, FSDPConfig, KeelConfig
from keel.config.trainer import OffPolicy
from keel.config.values import value_at
from keel.config.verl_rules import DIFFERENT_DEFAULTS
from keel.types import OldLogProbSource


@dataclass(frozen=True)
class Sharding:
    """DDP or FSDP for the policy, chosen by keel when the config left it open."""

    # the actor's fsdp_size: 1 (DDP) or -1 (FSDP over every worker)
    fsdp_size: int
    why: str


@dataclass(frozen=True)
class Plan:
    """Every decision keel makes after reading the config. Read by `keel check`, the trainer and
    the workers in place of the config's own values where keel chose for the user."""

    # the keys the config set (what keel may choose); None: a config built in code, taken as it is
    given: frozenset[str] | None
    # "key: what keel took and why", for `keel check`'s "decided for you"
    decided: tuple[str, ...]
    off_policy: OffPolicy
    # the rollout correction the run applies (async mode may turn it on)
    rollout_correction: RolloutCorrectionConfig
    # where the update's old log-probs come from
    old_log_probs: OldLogProbSource
    # scoring processes (async mode scores in processes when the config left it open)
    reward_workers: int
    # where and when samples are scored, in a line
    rewards: str
    # the policy's workers (n_gpus_per_node x nnodes)
    workers: int
    # None: nothing to choose (one worker, or the config says), or not chosen yet
    sharding: Sharding | None = None

    def left_to_keel(self, key_prefix: str) -> bool:
        """The config set no key under `key_prefix` (a config built in code sets them all)."""
        return self.given is not None and not any(k.startswith(key_prefix) for k in self.given)

    def with_sharding(self, sharding: Sharding | None) -> Plan:
        return replace(self, sharding=sharding)

    def actor_fsdp(self, cfg: KeelConfig) -> FSDPConfig:
        """The actor's fsdp_config as the run applies it: the config's, with keel's fsdp_size."""
        fsdp = cfg.actor_rollout_ref.actor.fsdp_config
        return replace(fsdp, fsdp_size=self.sharding.fsdp_size) if self.sharding else fsdp

    def policy(self, cfg: KeelConfig) -> ActorRolloutRefConfig:
        """The policy's sections as its workers apply them: a copy with keel's sharding."""
        policy = cfg.actor_rollout_ref
        if self.sharding is None:
            return policy
        return replace(policy, actor=replace(policy.actor, fsdp_config=self.actor_fsdp(cfg)))

    def applied(self, cfg: KeelConfig) -> KeelConfig:
        """A copy of `cfg` with keel's decisions in place: what keel before the plan wrote into
        the config, and so into a checkpoint's config.yaml, which a resume compares against."""
        return replace(
            cfg,
            algorithm=replace(cfg.algorithm, rollout_correction=self.rollout_correction),
            reward=replace(cfg.reward, num_workers=self.reward_workers),
            actor_rollout_ref=self.policy(cfg),
        )


def plan_of(
    cfg: KeelConfig,
    given: frozenset[str] | None = None,
    decided: tuple[str, ...] = (),
    adapted: frozenset[str] = frozenset(),
) -> Plan:
    """The plan of a loaded config. `given`: the keys its source set (None: all of them);
    `decided`: what the loader already took for the user (verl keys, verl's nulls); `adapted`: the
    keys set under keel's names once verl's were read (renamed, derived)."""
    off = cfg.trainer.off_policy
    # verl's keys under keel's names too
    set_keys = None if given is None else given | adapted
    correction, correction_note = _off_policy_correction(cfg, off, set_keys)
    left_open = set_keys is not None and "reward.num_workers" not in set_keys
    workers, workers_note = _reward_workers(cfg, off, left_open)
    notes = [note for note in (correction_note, workers_note) if note]
    notes += [
        f"{key}: keel's {value_at(cfg, key)!r}, verl's {verl!r}: {why}"
        for key, (verl, why) in DIFFERENT_DEFAULTS.items()
        if given is not None and key not in given
    ]
    return Plan(
        given=given,
        decided=(*decided, *notes),
        off_policy=off,
        rollout_correction=correction,
        old_log_probs=old_log_probs_source(cfg, correction),
        reward_workers=workers,
        rewards=reward_scoring(cfg, workers),
        workers=cfg.world_size,
    )


def _reward_workers(cfg: KeelConfig, off: OffPolicy, left_open: bool) -> tuple[int, str | None]:
    """Async mode scores beside the trainer: with reward.num_workers unset, in processes (verl's
    count), where a scorer's own signal-based timeout works and a runaway one is ended, not left
    running in the trainer."""
    workers = cfg.reward.num_workers
    if not off.ahead or not left_open or workers != 0:
        return workers, None
    workers = min(8, os.cpu_count() or 1)
    return workers, (
        f"reward.num_workers: {workers}, since trainer.mode=async scores beside the trainer "
        "(in processes a scorer's timeout ends it; 0 scores on a thread of the trainer's process)"
    )


def _off_policy_correction(
    cfg: KeelConfig, off: OffPolicy, given: frozenset[str] | None
) -> tuple[RolloutCorrectionConfig, str | None]:
    """Async samples are up to `bound` policy versions old. With no rollout correction asked for,
    PPO's ratio and clip are taken against the sampler's log-probs (bypass mode: the policy that
    sampled them is the old one), as verl's fully async trainer does (use_rollout_log_probs), which
    also saves the old-log-prob pass; a policy loss other than vanilla takes token-level truncated
    IS weights instead (decoupled)."""
    correction, k = cfg.algorithm.rollout_correction, off.bound
    chosen = given is None or any(key.startswith("algorithm.rollout_correction.") for key in given)
    # greedy engines record log-probs at temperature 1, not the policy's: nothing to correct with
    if (
        k == 0
        or chosen
        or not cfg.actor_rollout_ref.rollout.do_sample
        or correction.decoupled
        or correction.bypass_mode
    ):
        return correction, None
    why = (
        f"since trainer.mode=async trains samples up to {k} policy version{'s' if k > 1 else ''} "
        "old"
    )
    if cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "vanilla":
        return replace(correction, bypass_mode=True), (
            f"algorithm.rollout_correction.bypass_mode: true, {why}: PPO's ratio and clip are "
            "taken against the log-probs of the policy that sampled them, as verl's fully async "
            "trainer does, and the old-log-prob pass is saved (set rollout_is or rollout_rs for "
            "decoupled correction instead)"
        )
    return replace(correction, rollout_is="token"), (
        f"algorithm.rollout_correction.rollout_is: 'token', {why} (truncated IS weights at "
        f"{correction.rollout_is_threshold} correct for it; set rollout_is or rollout_rs to choose "
        "otherwise)"
    )


@dataclass(frozen=True)
class RolePlan:
    # per ppo epoch
    mini_batches: int
    samples_per_mini_batch: int
    # each worker's share of a mini-batch
    samples_per_worker: int
    # on each worker; 0 with a token budget (use_dynamic_bsz)
    micro_batches_per_mini_batch: int
    optimizer_steps_per_rollout: int
    # use_dynamic_bsz
    max_tokens_per_micro_batch: int | None = None


@dataclass(frozen=True)
class BatchPlan:
    prompts_per_step: int
    samples_per_step: int
    workers: int
    actor: RolePlan
    critic: RolePlan | None
    # samples x (max prompt + max response)
    max_tokens_per_step: int
    # where the update's old log-probs come from
    old_log_probs: str = "recomputed each step"
    # trainer.mode, explained
    mode: str = "sync: each step trains the samples it generated"
    # where and when samples are scored
    rewards: str = "in the trainer's process, each batch whole"

    def as_dict(self) -> dict:
        return asdict(self)

    def render(self) -> str:
        rows = [
            ("prompts per step", self.prompts_per_step),
            ("samples per step (x rollout.n)", self.samples_per_step),
            ("workers (n_gpus_per_node x nnodes)", self.workers),
            ("tokens per step, at most", self.max_tokens_per_step),
            ("old log-probs", self.old_log_probs),
            ("training", self.mode),
            ("rewards", self.rewards),
        ]
        for name, role in (("actor", self.actor), ("critic", self.critic)):
            if role is None:
                continue
            rows += [
                (f"{name}: mini-batches per epoch", role.mini_batches),
                (f"{name}: samples per mini-batch", role.samples_per_mini_batch),
                (f"{name}: samples per mini-batch per worker", role.samples_per_worker),
                (
                    f"{name}: micro-batches per mini-batch per worker",
                    role.micro_batches_per_mini_batch
                    or f"as many as fit {role.max_tokens_per_micro_batch} tokens",
                ),
                (f"{name}: optimiser steps per rollout", role.optimizer_steps_per_rollout),
            ]
        width = max(len(label) for label, _ in rows)
        return "batch plan\n" + "\n".join(f"  {label:<{width}}  {value}" for label, value in rows)

    def summary(self) -> str:
        """The plan in a few lines, as `keel train` prints it before step 1 (`render` is the
        table)."""
        workers = f"{self.workers} worker{'s' if self.workers > 1 else ''}"
        lines = [
            f"batch plan: {self.prompts_per_step} prompts x "
            f"{self.samples_per_step // self.prompts_per_step} samples = {self.samples_per_step} "
            f"a step on {workers}, at most {self.max_tokens_per_step} tokens"
        ]
        for name, role in (("actor", self.actor), ("critic", self.critic)):
            if role is None:
                continue
            micro = (
                f"{role.micro_batches_per_mini_batch} micro-batches"
                if role.micro_batches_per_mini_batch
                else f"micro-batches of at most {role.max_tokens_per_micro_batch} tokens"
            )
            lines.append(
                f"  {name}: {role.mini_batches} mini-batches of {role.samples_per_mini_batch} "
                f"samples ({micro} each per worker), {role.optimizer_steps_per_rollout} optimiser "
                "steps a rollout"
            )
        lines.append(f"  old log-probs: {self.old_log_probs}")
        lines.append(f"  training: {self.mode}")
        lines.append(f"  rewards: {self.rewards}")
        return "\n".join(lines)


def make_plan(cfg: KeelConfig, plan: Plan | None = None) -> BatchPlan:
    """The batch plan of `cfg` under `plan` (None: the config's own, as written)."""
    plan = plan or plan_of(cfg)
    n = cfg.actor_rollout_ref.rollout.n
    prompts = cfg.data.train_batch_size
    actor = cfg.actor_rollout_ref.actor

    workers = cfg.world_size

    def role(mini_prompts: int, micro: int, epochs: int, max_tokens: int | None) -> RolePlan:
        minis = prompts // mini_prompts
        # a short share is padded to this size
        per_worker = -(-mini_prompts * n // workers)
        micros = 0 if max_tokens else -(-per_worker // micro)
        return RolePlan(minis, mini_prompts * n, per_worker, micros, minis * epochs, max_tokens)

    critic = None
    if cfg.critic_enabled:
        critic = role(
            *cfg.critic_batching,
            cfg.critic.ppo_max_token_len_per_gpu if cfg.critic.use_dynamic_bsz else None,
        )
    return BatchPlan(
        prompts_per_step=prompts,
        samples_per_step=prompts * n,
        workers=workers,
        actor=role(
            actor.ppo_mini_batch_size,
            actor.ppo_micro_batch_size_per_gpu,
            actor.ppo_epochs,
            actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None,
        ),
        critic=critic,
        max_tokens_per_step=prompts
        * n
        * (cfg.data.max_prompt_length + cfg.data.max_response_length),
        old_log_probs=OLD_LOG_PROBS[plan.old_log_probs],
        mode=training_mode(cfg, plan),
        rewards=plan.rewards,
    )


def reward_scoring(cfg: KeelConfig, workers: int) -> str:
    """Where and when a step's samples are scored by `workers` scoring processes, in a line:
    beside generation where it can be."""
    reward = cfg.reward
    if reward.service.url:
        return "by the reward service, each batch whole"
    if cfg.custom_reward_function.batched:
        return "by your batched function, each batch whole"
    if workers == 0:
        return (
            "in the trainer's process, each batch whole (set reward.num_workers > 0 to score "
            "beside generation)"
        )
    where = f"in {workers} scoring processes"
    if not reward.score_ahead:
        return f"{where}, each batch whole (reward.score_ahead=false)"
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name == "hf":
        return (
            f"{where}, each batch whole (transformers' generate does not tell samples as they "
            "finish)"
        )
    episodes = rollout.multi_turn.enable or rollout.agent.function or rollout.agent.environment
    whole = (
        " (episodes with an environment or verl's lifecycle tools, and agent code: each batch "
        "whole)"
    )
    return f"{where}, each sample as it finishes, beside generation" + (whole if episodes else "")


# Where the update's old log-probs come from: the one place that decides it (the trainer runs it,
# the batch plan says it).
OLD_LOG_PROBS = {
    OldLogProbSource.SAMPLER: "the sampler's (rollout_correction.bypass_mode): no pass",
    OldLogProbSource.UPDATE: "the update's own forward (on-policy): no pass",
    OldLogProbSource.FIRST_MINI_BATCH: (
        "recomputed each step, but the first mini-batch's (the update's own forward)"
    ),
    OldLogProbSource.RECOMPUTED: "recomputed each step",
}


def old_log_probs_source(cfg: KeelConfig, correction: RolloutCorrectionConfig) -> OldLogProbSource:
    """A key of OLD_LOG_PROBS. SAMPLER in bypass mode. Otherwise an update's first mini-batch runs
    before any optimiser step, so its own forward, detached, is the old policy's (UPDATE when that
    mini-batch is the whole batch, FIRST_MINI_BATCH when one epoch has several): not when the
    reward's KL needs them before the update, not with a batch-invariant rollout (its pass is the
    sampler's arithmetic), not under guards.nonfinite=skip (the pass is where a non-finite log-prob
    skips a step), not under decoupled rollout correction (it weighs the old policy against the
    sampler), and not with several epochs (later epochs revisit the samples with the policy moved).
    RECOMPUTED else: the pass over the whole batch. `correction`: the plan's rollout correction."""
    actor = cfg.actor_rollout_ref.actor
    if correction.bypass_mode:
        return OldLogProbSource.SAMPLER
    own_forward = not (
        cfg.actor_rollout_ref.rollout.batch_invariant
        or cfg.algorithm.use_kl_in_reward
        or cfg.trainer.guards.nonfinite == "skip"
        or correction.decoupled
        or actor.ppo_epochs != 1
    )
    if not own_forward:
        return OldLogProbSource.RECOMPUTED
    if actor.ppo_mini_batch_size == cfg.data.train_batch_size:
        return OldLogProbSource.UPDATE
    return OldLogProbSource.FIRST_MINI_BATCH


def training_mode(cfg: KeelConfig, plan: Plan) -> str:
    """The off-policy value in a line: what runs ahead, how old a trained sample may be, what it
    holds."""
    off = plan.off_policy
    k = off.bound
    if k == 0:
        return f"{off.name}: each step trains the samples it generated"
    correction = plan.rollout_correction
    corrected = "bypass mode" if correction.bypass_mode else f"rollout_is={correction.rollout_is}"
    samples = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    tokens = samples * (cfg.data.max_prompt_length + cfg.data.max_response_length)
    # ids, masks and log-probs: about 40 bytes a token on the host
    held_mb = k * tokens * 40 / 2**20
    versions = f"{k} policy version{'s' if k > 1 else ''}"
    if off.partial:
        return (
            f"async with partial rollouts: {k + 1} batches of {samples} samples are under way; a "
            "step's round ends once a batch of groups has finished and the rest go on under the "
            f"next policy, no token more than {versions} old ({_strategy(off.strategy)}; rollout "
            f"correction: {corrected}); about {held_mb * (k + 1) / k:.0f} MB on the host at most"
        )
    return (
        f"async: generation and scoring run up to {k} step{'s' if k > 1 else ''} ahead of "
        f"training, so a trained sample is at most {versions} old (rollout correction: "
        f"{corrected}); {k} batch{'es' if k > 1 else ''} of {samples} samples wait on the host, "
        f"about {held_mb:.0f} MB at most"
    )


def _strategy(strategy: str) -> str:
    if strategy == "wait":
        return "wait: a step trains the oldest batch drawn, once all of it has finished"
    return (
        "drop: a group that would pass it is dropped, and a step trains the first groups to finish"
    )
