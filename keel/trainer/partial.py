"""Partial rollouts (trainer.mode=async with trainer.partial_rollout): a step's generation no longer
waits for its slowest sample.

The rollout keeps a pool of samples under way, max_off_policy_steps + 1 batches of prompts. Each
step runs one round over the whole pool with the policy the step starts with, and ends it once the
step's batch of groups (data.train_batch_size prompts, all their samples) has finished; what is
still generating then is cut, keeps its tokens and the sampler's log-probs, and goes on in the next
round under the next policy, each token tagged with the version it was sampled from
(`GeneratedBatch.token_versions`). The younger batches decode beside the oldest one's long tail
instead of after it.

Which batch a step trains is trainer.off_policy_strategy:
- `wait`: the oldest batch drawn, once all its groups have finished. Prompts train in the order
  drawn,
  as in sync mode, and none is dropped; a batch is drawn k = max_off_policy_steps steps before it
  trains, so none of its tokens is more than k versions older than the policy its update starts
  from.
- `drop`: the first batch of groups to finish (those that would pass the bound by waiting another
  step
  first: due); a due group still generating is dropped (`async/dropped`), so long responses are
  trained less often than they are sampled: verl's trade of bias for speed.

A sample begins scoring as soon as a round finds it finished, in the reward's worker processes, so
the groups a step does not train yet are scored while later steps generate and train; a group that
a failed scoring left short (reward.on_error=mask) is replaced by another round's. A checkpoint
keeps the pool's prompts, not its tokens: a resume generates them again from the start, and draws no
prompt twice.
"""

from __future__ import annotations

import dataclasses

import torch

from keel.config.schema import KeelConfig
from keel.data.prompts import collate_prompts
from keel.data.sampler import ResumableSampler
from keel.observe.metrics import Timer
from keel.rollout.assemble import padded_rows
from keel.trainer.scored_rollout import ScoredRollout
from keel.trainer.seeds import batch_seed, step_seed
from keel.types import (
    GeneratedBatch,
    GenerationResult,
    PartialSample,
    RoundEnd,
    ScoredBatch,
    StepSamples,
    groups_of,
)


class RolloutPartial:
    """`rollout(timer, step)` -> the batch step `step` trains, from the pool's round of that
    step."""

    def __init__(self, cfg: KeelConfig, rollout: ScoredRollout, sampler: ResumableSampler):
        self.cfg, self.rollout, self.sampler = cfg, rollout, sampler
        self.bound = cfg.trainer.max_off_policy_steps
        self.drop = cfg.trainer.off_policy_strategy == "drop"
        self.groups_per_batch = cfg.data.train_batch_size
        # in the order drawn: a group's samples together
        self.pool: list[PartialSample] = []
        # a resume: the pool's prompts (the sampler's rows), drawn again first
        self.restored: list[int] = []
        # group -> its prompt's row in the training data (what the sampler gives)
        self.row_of: dict[int, int] = {}
        self.next_group = 0
        # (group, sample) -> its scoring, begun when it finished
        self.scoring: dict[tuple[int, int], object] = {}

    def __call__(self, timer: Timer, step: int) -> StepSamples:
        """The step's batch, scored: one round's finished groups; with algorithm.filter_groups
        (DAPO's dynamic sampling), more rounds with the same policy while too few of them have a
        signal, the pool refilled from the sampler each time."""
        updates = int(step >= self.cfg.algorithm.critic_warmup)
        dropped: list[int] = []

        def next_round(call: int, wanted: int) -> GenerationResult:
            seed = batch_seed(step_seed(self.cfg, step), call)
            generated = self._round(timer, seed, updates, wanted)
            dropped.append(generated.dropped)
            return generated

        samples = self.rollout.fill(timer, next_round, whole_groups=True)
        metrics = {**samples.metrics, **self._metrics(samples.batch, sum(dropped))}
        return dataclasses.replace(samples, metrics=metrics)

    def _round(self, timer: Timer, seed: int, updates: int, wanted: int) -> GenerationResult:
        """One round over the pool -> `wanted` of its finished groups as a batch, with the engine's
        timing, the samples' scoring begun and how many samples were dropped. Every sample that
        finished in the round begins scoring now, in the background: the groups that train later
        are scored by then."""
        self._fill_pool()
        due = self._due(updates) if self.drop else set()
        oldest = frozenset(groups_of(self.pool)[:wanted])
        end = RoundEnd(count=wanted) if self.drop else RoundEnd(groups=oldest)
        gen_parts: dict[str, float] = {}
        with timer("gen"):
            # once, unless a rank's share of `end` fell short
            while not self._reached(end):
                self.pool, parts = self.rollout.generate_round(self.pool, seed, end)
                gen_parts = {k: gen_parts.get(k, 0.0) + v for k, v in parts.items()}
        for s in self.pool:
            if s.finished and (s.group, s.sample) not in self.scoring:
                self.scoring[s.group, s.sample] = self._start_scoring(s)
        trained, dropped = self._take(oldest, due, wanted)
        started = [self.scoring.pop((s.group, s.sample)) for s in trained]
        return GenerationResult(
            batch=samples_batch(trained, self.rollout.components.tokenizer),
            timing=gen_parts,
            started=started,
            dropped=dropped,
        )

    def _fill_pool(self) -> None:
        """Prompts drawn until the pool holds max_off_policy_steps + 1 batches of groups (a resume's
        first)."""
        data = self.rollout.components.train_data
        while len(groups_of(self.pool)) < (self.bound + 1) * self.groups_per_batch:
            rows, self.restored = self.restored or self.sampler.next_batch(), []
            for row in rows:
                self.pool += [
                    PartialSample(self.next_group, data[row], sample=k)
                    for k in range(self.rollout.sampling.n)
                ]
                self.row_of[self.next_group] = row
                self.next_group += 1

    def _due(self, updates: int) -> set[int]:
        """The groups that would pass the bound if this step did not train them: their first tokens
        more than max_off_policy_steps versions older than the policy the next step's update starts
        from (`updates`: whether this step updates the actor)."""
        next_update = self.rollout.components.workers.policy_version + updates
        return {
            s.group for s in self.pool if s.versions and next_update - s.versions[0] > self.bound
        }

    def _reached(self, end: RoundEnd) -> bool:
        return end.reached([s.group for s in self.pool], [s.finished for s in self.pool])

    def _start_scoring(self, sample: PartialSample):
        if not self.rollout.scores_ahead:
            return None
        text = self.rollout.components.tokenizer.decode(sample.ids, skip_special_tokens=True)
        return self.rollout.start_scoring(sample.record, text)

    def _take(
        self, oldest: frozenset, due: set[int], wanted: int
    ) -> tuple[list[PartialSample], int]:
        """(the step's samples, how many samples were dropped), the pool left with the rest. `wait`:
        the `wanted` oldest groups; `drop`: `wanted` finished groups, the due ones first, then the
        oldest, and the due groups still unfinished are dropped."""
        if not self.drop:
            trained, dropped = set(oldest), set()
        else:
            finished = [
                g
                for g in groups_of(self.pool)
                if all(s.finished for s in self.pool if s.group == g)
            ]
            # a stable sort
            trained = set(sorted(finished, key=lambda g: g not in due)[:wanted])
            dropped = due - trained
        taken = [s for s in self.pool if s.group in trained]
        left = [s for s in self.pool if s.group not in trained and s.group not in dropped]
        count = len(self.pool) - len(taken) - len(left)
        self.pool = left
        self.row_of = {
            g: row for g, row in self.row_of.items() if g not in trained and g not in dropped
        }
        self.scoring = {
            key: started for key, started in self.scoring.items() if key[0] not in dropped
        }
        return taken, count

    def _metrics(self, batch: ScoredBatch, dropped: int) -> dict[str, float]:
        staleness = (self.rollout.components.workers.policy_version - batch.policy_version).float()
        versions, mask = batch.token_versions, batch.response_mask.bool()
        spans = (versions.masked_fill(~mask, -1).amax(-1) > batch.policy_version).float()
        return {
            "async/staleness/mean": staleness.mean().item(),
            "async/staleness/max": staleness.max().item(),
            # trained samples whose tokens came from more than one policy
            "async/partial": spans.mean().item(),
            "async/dropped": float(dropped),
            "async/in_flight": float(len(self.pool)),
        }

    def settle(self) -> None:
        """Nothing to wait for: samples begun scoring ahead stay in the reward's processes, and a
        validation's scoring counts them in its deadline."""

    def resume_state(self) -> tuple[dict, dict]:
        """(the sampler state a resume starts from, what else it needs: the pool's prompts, drawn
        again first, and how many samples under way it drops)."""
        rows = [self.row_of[g] for g in groups_of(self.pool)]
        return self.sampler.state_dict(), {
            "in_flight_dropped": len(self.pool),
            "pool_prompts": rows,
        }

    def start_at(self, step: int, state: dict | None = None) -> None:
        self.restored = list((state or {}).get("pool_prompts", []))

    def close(self) -> None:
        """No thread of its own to stop."""


def samples_batch(samples: list[PartialSample], tokenizer) -> GeneratedBatch:
    """Finished samples as a GeneratedBatch, their prompts left-padded and responses right-padded as
    the engines' batches are; each sample's policy version is its oldest token's."""
    pad = tokenizer.pad_token_id
    prompts = collate_prompts([s.record for s in samples], pad)

    ids = padded_rows([s.ids for s in samples], pad, torch.long)  # [N, R]
    lengths = torch.tensor([len(s.ids) for s in samples])
    mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
    return GeneratedBatch(
        prompt_ids=prompts.input_ids,
        prompt_mask=prompts.attention_mask,
        response_ids=ids,
        response_mask=mask,
        sampling_log_probs=padded_rows([s.log_probs for s in samples], 0.0, torch.float32),
        group_index=torch.tensor([s.group for s in samples]),
        records=prompts.records,
        response_texts=tokenizer.batch_decode([s.ids for s in samples], skip_special_tokens=True),
        truncated=torch.tensor([s.truncated for s in samples]),
        policy_version=torch.tensor([s.versions[0] for s in samples]),
        token_versions=padded_rows([s.versions for s in samples], 0, torch.long),
    )
