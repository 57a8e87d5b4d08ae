"""The driver's view of its workers: each call splits a batch across ranks, runs the role's
method on every rank, and puts the results back in batch order. With one worker the split is
the whole batch and nothing is copied."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from keel.config.schema import KeelConfig
from keel.data.prompts import PromptBatch
from keel.trainer.seeds import actor_order_seed, critic_order_seed, rank_seed
from keel.training.batching import (
    concat_rows,
    contiguous_shares,
    minibatch_indices,
    plan_minibatches,
    shard_batch,
    unshard_rows,
)
from keel.types import (
    GeneratedBatch,
    PartialSample,
    RolloutBatch,
    RoundEnd,
    SamplingParams,
    ScoredBatch,
    groups_of,
)

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
    ):
        """`critic_group`: the critic's own workers (critic.enable_resource_pool); by default the
        critic is colocated in `group`. `rollout_group`: the rollout's own workers
        (hybrid_engine=false), which take the actor's weights after each update; by default each
        of `group`'s workers generates with its own engine."""
        self.group = group
        self.critic_group = critic_group or group
        self.rollout_group = rollout_group
        self.actor_schedule, self.critic_schedule = actor, critic
        self.world = group.world_size
        self.pad_token_id = pad_token_id
        # the policy version the workers hold: actor updates so far (the one source)
        self.policy_version = 0
        # method -> the fullest GPU's peak during its last call
        self.peak_gb: dict[str, float] = {}
        self.rss_gb = 0.0

    @classmethod
    def of(
        cls, group, cfg: KeelConfig, pad_token_id: int, critic_group=None, rollout_group=None
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
        roles = cls(group, pad_token_id, actor, critic, critic_group, rollout_group)
        # its engine holds the base alone: the
        if rollout_group is not None and policy.model.lora_rank > 0:
            # adapters a checkpoint or lora_adapter_path gave reach it before it generates
            roles._send_weights()
        return roles

    # --- rollout
    # -----------------------------------------------------------------------------------
    def generate(
        self, prompts: PromptBatch, sampling: SamplingParams, seed: int, on_finished=None
    ) -> tuple[GeneratedBatch, dict[str, float]]:
        """The samples, and the engine's timing of its parts (`timing_s/gen_*`, the slowest rank's:
        where the phase's time went). Contiguous slices of the prompts, one per rank (generation
        has no collectives, so the slices may differ in size or be empty). `on_finished(row, record,
        response text)`: told of each sample as it finishes, where the generator can."""
        return self.submit_generate(prompts, sampling, seed, on_finished).result()

    def submit_generate(
        self, prompts: PromptBatch, sampling: SamplingParams, seed: int, on_finished=None
    ) -> Future:
        """generate, started: a future of what it returns. On the rollout's own workers the driver
        goes on (the actor trains) while they generate."""
        group = self.rollout_group or self.group
        shares = contiguous_shares(len(prompts), group.world_size)
        parts = [_slice_prompts(prompts, start, end) for start, end in shares]
        tellers, all_told = _tellers(group, on_finished, shares)
        per_rank = [
            (p, sampling, rank_seed(seed, r), t) for r, (p, t) in enumerate(zip(parts, tellers))
        ]
        submitted = group.submit("generate", per_rank)

        def samples(replies) -> tuple[GeneratedBatch, dict[str, float]]:
            # every finished sample handed to on_finished before the batch is
            all_told()
            return self._samples(shares, self._noted("generate", replies))

        return then(submitted, samples)

    def generate_round(
        self, samples: list[PartialSample], sampling: SamplingParams, seed: int, end: RoundEnd
    ) -> tuple[list[PartialSample], dict[str, float]]:
        """Partial rollouts: a round of `samples` (whole groups to a rank, each rank ending at its share of
        `end`) -> the samples continued, in order, and the slowest rank's timing of the engine's parts."""
        group = self.rollout_group or self.group
        groups = groups_of(samples)
        parts, ends = [], []
        for (start, stop), (count, count_end) in zip(
            contiguous_shares(len(groups), group.world_size),
            contiguous_shares(end.count, group.world_size),
        ):
            mine = set(groups[start:stop])
            parts.append([s for s in samples if s.group in mine])
            # a rank's share of the count, at least one where it has groups: a share of 0 would end
            # its round before its groups took a token (the driver takes only the batch it needs)
            ends.append(
                RoundEnd(
                    end.groups & mine, min(len(mine), max(count_end - count, 1)) if end.count else 0
                )
            )
        per_rank = [
            (p, sampling, rank_seed(seed, r), e) for r, (p, e) in enumerate(zip(parts, ends))
        ]
        replies = self._noted("generate_round", group.call("generate_round", per_rank))
        timing = {k: max(t.get(k, 0.0) for _, t in replies) for _, t in replies for k in t}
        return [s for continued, _ in replies for s in continued], timing

    def _samples(
        self, shares: list[tuple[int, int]], results: list
    ) -> tuple[GeneratedBatch, dict[str, float]]:
        timing = {k: max(t.get(k, 0.0) for _, t in results) for _, t in results for k in t}
        for (start, _), (batch, _) in zip(shares, results):
            # a rank numbers its own samples from 0
            if batch is not None and batch.sample_index is not None:
                batch.sample_index = batch.sample_index + start
        return concat_rows([b for b, _ in results if b is not None], self.pad_token_id), timing

    # --- forward passes
    # ------------------------------------------------------------------------------
    def actor_log_probs(self, batch: ScoredBatch) -> torch.Tensor:
        return self._per_token("compute_log_probs", batch)

    def ref_log_probs(self, batch: ScoredBatch) -> torch.Tensor:
        return self._per_token("compute_ref_log_probs", batch)

    def values(self, batch: ScoredBatch) -> torch.Tensor:
        return self._per_token("compute_values", batch, self.critic_group)

    def _per_token(self, method: str, batch: ScoredBatch, group=None) -> torch.Tensor:  # [N, R]
        group = group or self.group
        index, parts = shard_batch(batch, group.world_size)
        return unshard_rows(index, self._call(method, [(p,) for p in parts], group))

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

    def update_actor(self, batch: RolloutBatch, seed: int) -> dict[str, float]:
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
        self._noted("load_policy", self.rollout_group.call_all("load_policy", (weights, version)))
        return {"timing_s/sync_rollout_weights": time.perf_counter() - start}

    def update_critic(self, batch: RolloutBatch, seed: int) -> dict[str, float]:
        plan = _plan(
            batch, self.critic_schedule, critic_order_seed(seed), self.critic_group.world_size
        )
        return combine_metrics(self._call("update_critic", [(p,) for p in plan], self.critic_group))

    # --- checkpoints -----------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        """Every group writes its models' part of one checkpoint (the same files wherever the critic
        trains, so a run may resume with or without a critic pool)."""
        for group in self._groups():
            group.call("save", [(str(directory),)] * group.world_size)

    def load(self, directory: Path, weights_version: int = 0) -> None:
        """`weights_version`: the policy version of the checkpoint's weights (its actor updates)."""
        self.policy_version = weights_version
        for group in self._groups() + ([self.rollout_group] if self.rollout_group else []):
            group.call("load", [(str(directory), weights_version)] * group.world_size)

    def shutdown(self) -> None:
        for group in self._groups() + ([self.rollout_group] if self.rollout_group else []):
            group.shutdown()

    def _groups(self) -> list:
        return [self.group] + ([self.critic_group] if self.critic_group is not self.group else [])

    def memory_metrics(self) -> dict[str, float]:
        """Peak GPU memory per phase (the fullest GPU), the step's peak, and the largest worker RSS."""
        metrics = {f"perf/peak_memory_gb/{method}": gb for method, gb in self.peak_gb.items()}
        if self.peak_gb:
            metrics["perf/max_memory_allocated_gb"] = max(self.peak_gb.values())
        metrics["perf/max_rss_gb"] = self.rss_gb
        return metrics

    def _call(self, method: str, per_rank_args: list[tuple], group=None) -> list:
        return self._noted(method, (group or self.group).call(method, per_rank_args))

    def _noted(self, method: str, results) -> list:
        """A call's results, its ranks' memory readings noted."""
        readings = results.memory
        if any("gpu_peak_gb" in m for m in readings):
            self.peak_gb[method] = max(m.get("gpu_peak_gb", 0.0) for m in readings)
        self.rss_gb = max([self.rss_gb, *(m["rss_gb"] for m in readings)])
        return results


def _plan(batch: RolloutBatch, schedule: UpdateSchedule, seed: int, ranks: int) -> list:
    return plan_minibatches(
        batch,
        _rows_per_mini_batch(batch, schedule.samples_per_mini_batch),
        schedule.epochs,
        schedule.shuffle,
        seed,
        schedule.max_response_length,
        ranks,
    )


def _rows_per_mini_batch(batch: RolloutBatch, samples: int) -> int:
    """A mini-batch's rows: its samples, or, where samples train as several rows (segments), as many
    rows as keep the update's number of mini-batches what the samples make."""
    if batch.sample_index is None:
        return samples
    count = int(torch.unique(batch.sample_index).numel())
    return -(-samples * len(batch) // count)


def then(future: Future, read) -> Future:
    """A future of `read(future's result)`, or of its error."""
    chained: Future = Future()

    def done(finished: Future) -> None:
        try:
            chained.set_result(read(finished.result()))
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits on it
            chained.set_exception(error)

    future.add_done_callback(done)
    return chained


def _tellers(group, on_finished, shares: list[tuple[int, int]]) -> tuple[list, Callable[[], None]]:
    """Each rank's on_finished (the callback itself for a worker in this process, a teller over the
    group's channel for Ray ranks, None without one), and what waits until all have told theirs."""
    if on_finished is None:
        return [None] * len(shares), lambda: None
    # one rank: its rows are the prompts'
    if getattr(group, "in_process", False):
        return [on_finished], lambda: None
    channel = group.finished_channel()
    call, tellers = channel.open(on_finished, [start for start, _ in shares])
    return tellers, lambda: channel.wait(call)


def combine_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    combined = dict(per_rank[0])
    for metrics in per_rank[1:]:
        for name, value in metrics.items():
            if name not in REPLICATED_METRICS:
                combined[name] += value
    return combined


def _slice_prompts(prompts: PromptBatch, start: int, end: int) -> PromptBatch | None:
    if start == end:
        return None
    return PromptBatch(
        prompts.input_ids[start:end], prompts.attention_mask[start:end], prompts.records[start:end]
    )
