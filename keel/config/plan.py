"""The batch plan: what one RL step does, in numbers, printed and saved at start.

verl's batch sizes are counted in prompts for mini-batches and in samples for micro-batches; the
plan spells out both so nobody has to multiply by `rollout.n` in their head.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from keel.config.schema import KeelConfig
from keel.types import OldLogProbSource


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
        """The plan in a few lines, as `keel train` prints it before step 1 (`render` is the table)."""
        workers = f"{self.workers} worker{'s' if self.workers > 1 else ''}"
        lines = [
            f"batch plan: {self.prompts_per_step} prompts x {self.samples_per_step // self.prompts_per_step} "
            f"samples = {self.samples_per_step} a step on {workers}, at most {self.max_tokens_per_step} tokens"
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
                f"  {name}: {role.mini_batches} mini-batches of {role.samples_per_mini_batch} samples "
                f"({micro} each per worker), {role.optimizer_steps_per_rollout} optimiser steps a rollout"
            )
        lines.append(f"  old log-probs: {self.old_log_probs}")
        lines.append(f"  training: {self.mode}")
        lines.append(f"  rewards: {self.rewards}")
        return "\n".join(lines)


def make_plan(cfg: KeelConfig) -> BatchPlan:
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
        old_log_probs=OLD_LOG_PROBS[old_log_probs_source(cfg)],
        mode=training_mode(cfg),
        rewards=reward_scoring(cfg),
    )


def reward_scoring(cfg: KeelConfig) -> str:
    """Where and when a step's samples are scored, in a line: beside generation where it can be."""
    reward, workers = cfg.reward, cfg.reward.num_workers
    if reward.service.url:
        return "by the reward service, each batch whole"
    if cfg.custom_reward_function.batched:
        return "by your batched function, each batch whole"
    if workers == 0:
        return "in the trainer's process, each batch whole (set reward.num_workers > 0 to score beside generation)"
    where = f"in {workers} scoring processes"
    if not reward.score_ahead:
        return f"{where}, each batch whole (reward.score_ahead=false)"
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name == "hf":
        return f"{where}, each batch whole (transformers' generate does not tell samples as they finish)"
    episodes = rollout.multi_turn.enable or rollout.agent.function or rollout.agent.environment
    whole = " (episodes with an environment or verl's lifecycle tools, and agent code: each batch whole)"
    return f"{where}, each sample as it finishes, beside generation" + (whole if episodes else "")


# Where the update's old log-probs come from: the one place that decides it (the trainer runs it,
# the batch plan says it).
OLD_LOG_PROBS = {
    OldLogProbSource.SAMPLER: "the sampler's (rollout_correction.bypass_mode): no pass",
    OldLogProbSource.UPDATE: "the update's own forward (on-policy): no pass",
    OldLogProbSource.FIRST_MINI_BATCH: "recomputed each step, but the first mini-batch's (the update's own forward)",
    OldLogProbSource.RECOMPUTED: "recomputed each step",
}


def old_log_probs_source(cfg: KeelConfig) -> OldLogProbSource:
    """A key of OLD_LOG_PROBS. SAMPLER in bypass mode. Otherwise an update's first mini-batch runs
    before any optimiser step, so its own forward, detached, is the old policy's (UPDATE when that
    mini-batch is the whole batch, FIRST_MINI_BATCH when one epoch has several): not when the
    reward's KL needs the old log-probs before the update, not under guards.nonfinite=skip (the pass
    is where a non-finite log-prob skips a step), not under decoupled rollout correction (it weighs
    the old policy against the sampler), and not with several epochs (later epochs revisit the
    samples with the policy moved). RECOMPUTED else: the old-log-prob pass over the whole batch."""
    actor = cfg.actor_rollout_ref.actor
    if cfg.algorithm.rollout_correction.bypass_mode:
        return OldLogProbSource.SAMPLER
    own_forward = not (
        cfg.algorithm.use_kl_in_reward
        or cfg.trainer.guards.nonfinite == "skip"
        or cfg.algorithm.rollout_correction.decoupled
        or actor.ppo_epochs != 1
    )
    if not own_forward:
        return OldLogProbSource.RECOMPUTED
    if actor.ppo_mini_batch_size == cfg.data.train_batch_size:
        return OldLogProbSource.UPDATE
    return OldLogProbSource.FIRST_MINI_BATCH


def training_mode(cfg: KeelConfig) -> str:
    """trainer.mode in a line: what runs ahead, how old a trained sample may be, what it holds."""
    k = cfg.trainer.max_off_policy_steps
    if cfg.trainer.mode == "sync" or k == 0:
        return f"{cfg.trainer.mode}: each step trains the samples it generated"
    correction = cfg.algorithm.rollout_correction
    corrected = "bypass mode" if correction.bypass_mode else f"rollout_is={correction.rollout_is}"
    samples = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    tokens = samples * (cfg.data.max_prompt_length + cfg.data.max_response_length)
    # ids, masks and log-probs: about 40 bytes a token on the host
    held_mb = k * tokens * 40 / 2**20
    versions = f"{k} policy version{'s' if k > 1 else ''}"
    if cfg.trainer.partial_rollout:
        return (
            f"async with partial rollouts: {k + 1} batches of {samples} samples are under way; a step's round ends "
            f"once a batch of groups has finished and the rest go on under the next policy, no token more than "
            f"{versions} old ({_strategy(cfg.trainer.off_policy_strategy)}; rollout correction: {corrected}); "
            f"about {held_mb * (k + 1) / k:.0f} MB on the host at most"
        )
    return (
        f"async: generation and scoring run up to {k} step{'s' if k > 1 else ''} ahead of training, so a trained "
        f"sample is at most {versions} old (rollout correction: {corrected}); "
        f"{k} batch{'es' if k > 1 else ''} of {samples} samples wait on the host, about {held_mb:.0f} MB at most"
    )


def _strategy(strategy: str) -> str:
    if strategy == "wait":
        return "wait: a step trains the oldest batch drawn, once all of it has finished"
    return (
        "drop: a group that would pass it is dropped, and a step trains the first groups to finish"
    )
