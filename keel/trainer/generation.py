"""The driver's generation calls on its workers: the rollout's own (hybrid_engine=false) or the
actor's, each generating with its engine. A batch of prompts is split into contiguous slices, one
per rank, and the samples come back in prompt order."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

from keel.data.prompts import PromptBatch
from keel.trainer.seeds import rank_seed
from keel.trainer.worker_memory import MemoryReadings
from keel.training.batching import concat_rows, contiguous_shares
from keel.types import GeneratedBatch, PartialSample, RoundEnd, SamplingParams, groups_of


class Generation:
    """Generation on one worker group."""

    def __init__(self, group, pad_token_id: int, memory: MemoryReadings):
        self.group, self.pad_token_id, self.memory = group, pad_token_id, memory

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
        group = self.group
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
            return self._samples(shares, self.memory.noted("generate", replies))

        return then(submitted, samples)

    def generate_round(
        self, samples: list[PartialSample], sampling: SamplingParams, seed: int, end: RoundEnd
    ) -> tuple[list[PartialSample], dict[str, float]]:
        """Partial rollouts: a round of `samples` (whole groups to a rank, each rank ending at its
        share of `end`) -> the samples continued, in order, and the slowest rank's timing of the
        engine's parts."""
        group = self.group
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
        replies = self.memory.noted("generate_round", group.call("generate_round", per_rank))
        timing = {k: max(t.get(k, 0.0) for _, t in replies) for _, t in replies for k in t}
        return [s for continued, _ in replies for s in continued], timing

    def _samples(
        self, shares: list[tuple[int, int]], results: list
    ) -> tuple[GeneratedBatch, dict[str, float]]:
        """The ranks' samples in prompt order, and the slowest rank's timing of each part."""
        timing = {k: max(t.get(k, 0.0) for _, t in results) for _, t in results for k in t}
        # a rank numbers its own samples from 0
        batches = [
            b if b.sample_index is None else replace(b, sample_index=b.sample_index + start)
            for (start, _), (b, _) in zip(shares, results)
            if b is not None
        ]
        return concat_rows(batches, self.pad_token_id), timing


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


def _slice_prompts(prompts: PromptBatch, start: int, end: int) -> PromptBatch | None:
    if start == end:
        return None
    return PromptBatch(
        prompts.input_ids[start:end], prompts.attention_mask[start:end], prompts.records[start:end]
    )
