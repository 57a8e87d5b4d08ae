"""The driver's view of its workers: each call splits a batch across ranks, runs the role's
method on every rank, and puts the results back in batch order. With one worker the split is
the whole batch and nothing is copied."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from keel.config.schema import KeelConfig
from keel.trainer.generation import Generation
from keel.trainer.seeds import actor_order_seed, critic_order_seed
from keel.trainer.worker_memory import MemoryReadings
from keel.training.batching import minibatch_indices, plan_minibatches, shard_batch, unshard_rows
from keel.training.teacher import TeacherScores
from keel.types import ScoredBatch, TrainBatch

# Metrics every rank reports identically (computed after the gradients were summed); every other
# update metric is a rank's share of the whole mini-batch, so the ranks' values add up.
REPLICATED_METRICS = (
    "actor/grad_norm",
    "actor/lr",
    "critic/grad_norm",
    "critic/lr",
    "timing_s/sync_rollout_weights",
)


@dataclass(frozen=True)
class UpdateSchedule:
    """How one role's update cuts a step's batch into mini-batches."""

    # ppo_mini_batch_size prompts x rollout.n
    samples_per_mini_batch: int
    # passes over the batch
    epochs: int
    # samples shuffled between mini-batches
    shuffle: bool
    # seq-mean-token-sum-norm's constant
    max_response_length: int


class WorkerRoles:
    def __init__(
        self,
        group,
        pad_token_id: int,
        actor: UpdateSchedule,
        critic: UpdateSchedule | None = None,
        critic_group=None,
        rollout_group=None,
        teacher_group=None,
    ):
        """`critic_group`: the critic's own workers (critic.enable_resource_pool); by default the
        critic is colocated in `group`, and so is the distillation teacher (`teacher_group`).
        `rollout_group`: the rollout's own workers (hybrid_engine=false), which take the actor's
        weights after each update; by default each of `group`'s workers generates with its own
        engine."""
        self.group = group
        self.critic_group = critic_group or group
        self.teacher_group = teacher_group or group
        # every group that holds models, each once
        self.groups = distinct([group, self.critic_group, self.teacher_group])
        self.rollout_group = rollout_group
        self.actor_schedule, self.critic_schedule = actor, critic
        self.world = group.world_size
        self.pad_token_id = pad_token_id
        # the policy version the workers hold: actor updates so far (the one source)
        self.policy_version = 0
        self.memory = MemoryReadings()
        # generation on the rollout's own workers, or on `group`'s
        self.generation = Generation(rollout_group or group, pad_token_id, self.memory)

    @classmethod
    def of(
        cls,
        group,
        cfg: KeelConfig,
        pad_token_id: int,
        critic_group=None,
        rollout_group=None,
        teacher_group=None,
    ) -> WorkerRoles:
        policy = cfg.actor_rollout_ref
        n, shuffle, length = policy.rollout.n, policy.actor.shuffle, cfg.data.max_response_length
        actor = UpdateSchedule(
            policy.actor.ppo_mini_batch_size * n, policy.actor.ppo_epochs, shuffle, length
        )
        critic_prompts, _, critic_epochs = cfg.critic_batching
        critic = (
            UpdateSchedule(critic_prompts * n, critic_epochs, shuffle, length)
            if cfg.critic_enabled
            else None
        )
        roles = cls(group, pad_token_id, actor, critic, critic_group, rollout_group, teacher_group)
        # its engine holds the base alone: the
        if rollout_group is not None and policy.model.lora_rank > 0:
            # adapters a checkpoint or lora_adapter_path gave reach it before it generates
            roles._send_weights()
        return roles

    # --- forward passes
    # ------------------------------------------------------------------------------
    def actor_log_probs(self, batch: ScoredBatch) -> torch.Tensor:
        return self._per_token("compute_log_probs", batch)[0]

    def ref_log_probs(self, batch: ScoredBatch) -> torch.Tensor:
        return self._per_token("compute_frozen", batch, role="ref")[0]

    def teacher_scores(self, batch: ScoredBatch) -> TeacherScores:
        return TeacherScores(
            *self._per_token("compute_frozen", batch, self.teacher_group, role="teacher")
        )

    def values(self, batch: ScoredBatch) -> torch.Tensor:
        return self._per_token("compute_values", batch, self.critic_group)[0]

    def _per_token(
        self, method: str, batch: ScoredBatch, group=None, role: str | None = None
    ) -> list[torch.Tensor]:
        """`method`'s outputs over the batch, each [N, ...] in batch order: every rank of `group`
        runs it on its part. `role`: the frozen model whose pass it is (compute_frozen's)."""
        group = group or self.group
        index, parts = shard_batch(batch, group.world_size)
        args = [(p,) if role is None else (role, p) for p in parts]
        per_rank = self._call(method, args, group, _FROZEN_PHASES.get(role))
        per_rank = [r if isinstance(r, tuple) else (r,) for r in per_rank]
        return [unshard_rows(index, [r[i] for r in per_rank]) for i in range(len(per_rank[0]))]

    # --- updates
    # -------------------------------------------------------------------------------------
    def first_mini_batch(self, batch: ScoredBatch, seed: int) -> torch.Tensor | None:
        """[N] bool: the samples that update_actor(batch, seed) takes first, while the policy is
        still the one that generated them (every sample when the update is one mini-batch: it is
        on-policy); None when the update runs several epochs (later epochs take those samples
        again, with the policy moved)."""
        schedule = self.actor_schedule
        if schedule.epochs != 1:
            return None
        first = torch.zeros(len(batch), dtype=torch.bool)
        mini_rows = _rows_per_mini_batch(batch, schedule.samples_per_mini_batch)
        first[
            minibatch_indices(len(batch), mini_rows, schedule.shuffle, actor_order_seed(seed))[0]
        ] = True
        return first

    def update_actor(self, batch: TrainBatch, seed: int) -> dict[str, float]:
        plan = _plan(batch, self.actor_schedule, actor_order_seed(seed), self.world)
        metrics = combine_metrics(self._call("update_actor", [(p,) for p in plan]))
        self.policy_version += 1
        if self.rollout_group is not None:
            metrics.update(self._send_weights())
        return metrics

    def _send_weights(self) -> dict[str, float]:
        """The actor's updated weights to the rollout's own workers, with their policy version (it
        waits for a generation they are running: the next one samples from these weights)."""
        start = time.perf_counter()
        weights, version = self._call("policy_weights", [()] * self.world)[0]
        self.memory.noted(
            "load_policy", self.rollout_group.call_all("load_policy", (weights, version))
        )
        return {"timing_s/sync_rollout_weights": time.perf_counter() - start}

    def update_critic(self, batch: TrainBatch, seed: int) -> dict[str, float]:
        plan = _plan(
            batch, self.critic_schedule, critic_order_seed(seed), self.critic_group.world_size
        )
        return combine_metrics(self._call("update_critic", [(p,) for p in plan], self.critic_group))

    # --- checkpoints -----------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        """Every group writes its models' part of one checkpoint (the same files wherever the critic
        trains, so a run may resume with or without a critic pool)."""
        for group in self.groups:
            group.call("save", [(str(directory),)] * group.world_size)

    def load(self, directory: Path, weights_version: int = 0) -> None:
        """`weights_version`: the policy version of the checkpoint's weights (its actor updates)."""
        self.policy_version = weights_version
        for group in self.groups + ([self.rollout_group] if self.rollout_group else []):
            group.call("load", [(str(directory), weights_version)] * group.world_size)

    def shutdown(self) -> None:
        for group in self.groups + ([self.rollout_group] if self.rollout_group else []):
            group.shutdown()

    def _call(
        self, method: str, per_rank_args: list[tuple], group=None, phase: str | None = None
    ) -> list:
        """`phase`: the name its memory readings go by (default: the method's)."""
        return self.memory.noted(phase or method, (group or self.group).call(method, per_rank_args))


# compute_frozen's memory readings, by role: the reference's keeps the name its records have
_FROZEN_PHASES = {"ref": "compute_ref_log_probs", "teacher": "compute_teacher"}


def distinct(groups: list) -> list:
    """The groups, each once (the critic and the teacher share the policy's unless pooled)."""
    return [g for i, g in enumerate(groups) if all(g is not other for other in groups[:i])]


def _plan(batch: TrainBatch, schedule: UpdateSchedule, seed: int, ranks: int) -> list:
    return plan_minibatches(
        batch,
        _rows_per_mini_batch(batch, schedule.samples_per_mini_batch),
        schedule.epochs,
        schedule.shuffle,
        seed,
        schedule.max_response_length,
        ranks,
    )


def _rows_per_mini_batch(batch: TrainBatch, samples: int) -> int:
    """A mini-batch's rows: its samples, or, where samples train as several rows (segments), as many
    rows as keep the update's number of mini-batches what the samples make."""
    if batch.sample_index is None:
        return samples
    count = int(torch.unique(batch.sample_index).numel())
    return -(-samples * len(batch) // count)


def combine_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    combined = dict(per_rank[0])
    for metrics in per_rank[1:]:
        for name, value in metrics.items():
            if name not in REPLICATED_METRICS:
                combined[name] += value
    return combined
