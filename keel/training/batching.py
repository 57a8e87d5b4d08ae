"""How a batch is cut, in one place: an update's mini-batches (the same ones one process would
take), each split across data-parallel ranks balancing tokens, each rank's part cut into
micro-batches (a fixed count, or packed to a token budget, grouped by length); and the results put
back in batch order. Nothing here computes: the forward passes live in `forward.py`, the optimiser
step in `step.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from keel.training import shared_prompt
from keel.training.step import LossScale, mask_counts
from keel.types import GeneratedBatch, TrainBatch, pad_responses, trim_padding

# --- mini-batches ----------------------------------------------------------------------------


def minibatch_indices(
    n_samples: int, mini_size: int, shuffle: bool, seed: int
) -> list[torch.Tensor]:
    """Split sample indices into mini-batches; the shuffle depends only on `seed`, so a resumed
    run takes the same mini-batches as an uninterrupted one."""
    if shuffle:
        order = torch.randperm(n_samples, generator=torch.Generator().manual_seed(seed))
    else:
        order = torch.arange(n_samples)
    return list(order.split(mini_size))


@dataclass
class MiniBatch:
    """One rank's part of a mini-batch, carrying the denominators of the whole mini-batch: the
    parts' losses then add up, over micro-batches and over ranks, to the loss of the whole."""

    samples: TrainBatch
    scale: LossScale
    # first mini-batch, non-zero advantages: its gradient must not be 0
    on_policy_signal: bool
    # the update's first mini-batch: the policy is still the sampler's
    first: bool = False
    # its micro-batches by how they were cut (micro_batches)
    _cut: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def micro_batches(self, how: MicroBatching) -> list[tuple[Tensor, TrainBatch]]:
        """micro_batches(self.samples, how), cut once: ahead of this mini-batch's turn where the
        update cuts it while the GPU runs the one before (cut_ahead)."""
        if how not in self._cut:
            self._cut[how] = micro_batches(self.samples, how)
        return self._cut[how]


def cut_ahead(upcoming: MiniBatch | None, how: MicroBatching) -> Callable[[], object] | None:
    """The host's work while the GPU finishes a mini-batch, before the sync that ends it: the next
    mini-batch's micro-batches cut (their sort, selection and trimming on the host had left t1's GPU
    idle 2.5-3.8 ms at each mini-batch's start, one H100)."""
    return None if upcoming is None else partial(upcoming.micro_batches, how)


def plan_minibatches(
    batch: TrainBatch,
    samples_per_mini: int,
    epochs: int,
    shuffle: bool,
    seed: int,
    norm_length: int | None,
    world_size: int = 1,
) -> list[list[MiniBatch]]:
    """Every rank's mini-batches for one update, in order: the same mini-batches one process would
    take, each split across ranks balancing tokens (equal sample counts, so every rank runs the
    same number of forward passes, which sharded weights need)."""
    per_rank: list[list[MiniBatch]] = [[] for _ in range(world_size)]
    for epoch in range(epochs):
        for i, index in enumerate(
            minibatch_indices(len(batch), samples_per_mini, shuffle, seed + epoch)
        ):
            mini = batch.select(index)
            scale = LossScale(*mask_counts(mini.loss_mask), norm_length)
            first = epoch == 0 and i == 0
            signal = first and bool((mini.advantages * mini.loss_mask).abs().sum() > 0)
            for rank, part in enumerate(shard_batch(mini, world_size)[1]):
                per_rank[rank].append(MiniBatch(part, scale, signal, first))
    return per_rank


# --- across ranks ----------------------------------------------------------------------------


def contiguous_shares(total: int, parts: int) -> list[tuple[int, int]]:
    """(start, end) of `parts` consecutive shares of `total` items, sizes differing by at most one
    (some empty when there are fewer items than parts)."""
    bounds = [total * r // parts for r in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def balanced_partitions(lengths: Tensor, parts: int) -> list[Tensor]:
    """Indices for `parts` ranks with equal sample counts (to within one) and token totals as
    close as a greedy pass gets: longest sample first, each into the open rank with fewest tokens.
    Each rank's indices are returned sorted, so its samples keep their batch order."""
    capacity = [
        len(lengths) // parts + (1 if r < len(lengths) % parts else 0) for r in range(parts)
    ]
    tokens = [0] * parts
    chosen: list[list[int]] = [[] for _ in range(parts)]
    for i in torch.argsort(lengths, descending=True, stable=True).tolist():
        rank = min(
            (r for r in range(parts) if len(chosen[r]) < capacity[r]), key=lambda r: tokens[r]
        )
        chosen[rank].append(i)
        tokens[rank] += int(lengths[i])
    return [torch.tensor(sorted(c), dtype=torch.long) for c in chosen]


def prompts_together(prompts: Tensor, prompt_mask: Tensor, lengths: Tensor) -> Tensor:
    """The samples in an order that keeps the samples of each prompt together, so a micro-batch
    computes its prompt once (shared_prompt.py): prompts by their longest sample, then each
    prompt's samples by length, shortest first. A prompt is its tokens, as shared_prompt.py
    shares them (left-padded rows [N, P] and their mask), not its group: a prompt drawn twice, or
    a multi-turn episode's segments, are shared by what they hold."""
    if prompts.numel() == 0:  # no samples, or only empty prompts: nothing to share
        return torch.argsort(lengths, stable=True)
    tokens = torch.where(prompt_mask.bool(), prompts, -1)
    _, group = torch.unique(tokens, dim=0, return_inverse=True)
    count = int(group.max()) + 1
    longest = torch.zeros(count, dtype=lengths.dtype).scatter_reduce(0, group, lengths, "amax")
    key = (longest[group] * count + group) * (int(lengths.max()) + 1) + lengths
    return torch.argsort(key, stable=True)


def sample_tokens(batch: TrainBatch) -> Tensor:  # [N]
    return batch.prompt_mask.sum(-1) + batch.response_tokens.sum(-1)


def shard_batch(batch: TrainBatch, parts: int) -> tuple[list[Tensor], list[TrainBatch]]:
    """(each rank's sample indices, each rank's part). Parts are token-balanced and of equal size:
    a part one short gets a copy of a sample with its response masked out, which adds nothing to
    any loss or count but keeps the ranks' forward passes in step."""
    if parts == 1:
        return [torch.arange(len(batch))], [batch]
    index = balanced_partitions(sample_tokens(batch), parts)
    size = max(len(i) for i in index)
    return index, [pad_with_masked(batch.select(i), size, batch) for i in index]


def unshard_rows(index: list[Tensor], results: list[Tensor]) -> Tensor:
    """Per-rank results [part, ...] back into batch order [N, ...]; padding rows are dropped."""
    # one worker: already in order
    if len(results) == 1:
        return results[0]
    n = sum(len(i) for i in index)
    out = results[0].new_zeros((n, *results[0].shape[1:]))
    for rows, result in zip(index, results):
        out[rows] = result[: len(rows)]
    return out


def pad_with_masked(part: TrainBatch, size: int, whole: TrainBatch) -> TrainBatch:
    """`part` of `whole` filled to `size` samples with masked copies of whole's first: a part may
    be empty (a mini-batch with fewer samples than ranks, as reward.on_error=mask can leave)."""
    missing = size - len(part)
    if missing == 0:
        return part
    # same widths: nothing is padded
    return concat_rows([part, whole.masked_copies(missing)], pad_id=0)


def concat_rows(batches: list[GeneratedBatch], pad_id: int) -> GeneratedBatch:
    """Batches stacked: prompts left-padded to the widest, responses right-padded to the widest."""
    # every batch of one stage's record
    kind = type(batches[0])
    width = max(b.response_ids.shape[1] for b in batches)
    prompt_width = max(b.prompt_ids.shape[1] for b in batches)
    fields = {}
    for f in dataclasses.fields(kind):
        values = [getattr(b, f.name) for b in batches]
        if values[0] is None:
            fields[f.name] = None
        elif isinstance(values[0], list):
            fields[f.name] = [v for value in values for v in value]
        elif f.name in ("prompt_ids", "prompt_mask"):
            fill = pad_id if f.name == "prompt_ids" else 0
            fields[f.name] = torch.cat(
                [
                    torch.nn.functional.pad(v, (prompt_width - v.shape[1], 0), value=fill)
                    for v in values
                ]
            )
        elif values[0].dim() >= 2:  # [n, R] and [n, R, k]
            fill = pad_id if f.name == "response_ids" else 0
            fields[f.name] = torch.cat([pad_responses(v, width, fill) for v in values])
        else:
            fields[f.name] = torch.cat(values)
    return kind(**fields)


# --- micro-batches ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MicroBatching:
    """How a batch is cut into forward passes: `size` samples each or, with `max_tokens` (verl's
    use_dynamic_bsz), as many samples as fit that many padded tokens."""

    size: int
    max_tokens: int | None = None

    @classmethod
    def of(cls, size: int, dynamic: bool, max_tokens: int) -> MicroBatching:
        """From a role's keys: its micro-batch size, use_dynamic_bsz and token budget."""
        return cls(size, max_tokens if dynamic else None)


def micro_batches(batch: TrainBatch, how: MicroBatching) -> list[tuple[Tensor, TrainBatch]]:
    """(sample indices, micro-batch) pairs, each micro-batch trimmed to its own longest prompt and
    response. Samples are grouped by length, so the order differs from the batch's (the losses do
    not depend on it: their denominators are the whole mini-batch's).

    Under data parallelism every rank must run the same number of forward passes (FSDP gathers
    weights in each): dynamic batching agrees on the count with the other ranks, and a rank with
    too few samples runs a masked filler (its index is empty)."""
    # by count, shortest to longest: similar lengths share a pass, less padding
    if how.max_tokens is None:
        lengths = sample_tokens(batch)
        order = torch.argsort(lengths, stable=True)
        if shared_prompt.SHARE_PROMPTS:
            order = prompts_together(batch.prompt_ids, batch.prompt_mask, lengths)
        index = [rows.sort().values for rows in order.split(how.size)]
    else:
        index = token_budget_bins(
            batch.prompt_mask.sum(-1), batch.response_tokens.sum(-1), how.max_tokens
        )
        index = _split_to_count(index, _count_across_ranks(len(index)))
    return [
        (rows, trim_padding(batch.select(rows) if len(rows) else batch.masked_copies(1)))
        for rows in index
    ]


def token_budget_bins(
    prompt_lengths: Tensor, response_lengths: Tensor, max_tokens: int
) -> list[Tensor]:
    """Samples packed longest first into micro-batches whose padded size (samples x (longest
    prompt + longest response)) stays within `max_tokens`; a sample longer than that goes alone."""
    order = torch.argsort(prompt_lengths + response_lengths, descending=True, stable=True).tolist()
    bins: list[list[int]] = []
    widest = (0, 0)
    for i in order:
        p, r = int(prompt_lengths[i]), int(response_lengths[i])
        if bins:
            wider = (max(widest[0], p), max(widest[1], r))
            if (len(bins[-1]) + 1) * (wider[0] + wider[1]) <= max_tokens:
                bins[-1].append(i)
                widest = wider
                continue
        bins.append([i])
        widest = (p, r)
    return [torch.tensor(sorted(b), dtype=torch.long) for b in bins]


def _count_across_ranks(count: int) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return count
    # a CPU tensor: gloo carries it (keel's GPU groups have gloo too)
    agreed = torch.tensor([count])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return int(agreed.item())


def _split_to_count(index: list[Tensor], count: int) -> list[Tensor]:
    """Halve the largest micro-batches until there are `count`; empty fillers if none can split."""
    index = list(index)
    while len(index) < count:
        largest = max(range(len(index)), key=lambda i: len(index[i]))
        if len(index[largest]) < 2:
            index.append(torch.zeros(0, dtype=torch.long))
            continue
        rows = index.pop(largest)
        index += list(rows.tensor_split(2))
    return index
