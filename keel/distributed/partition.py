"""Splitting a batch across data-parallel ranks, and putting the results back in order."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from keel.types import RolloutBatch


def contiguous_shares(total: int, parts: int) -> list[tuple[int, int]]:
    """(start, end) of `parts` consecutive shares of `total` items, sizes differing by at most one
    (some empty when there are fewer items than parts)."""
    bounds = [total * r // parts for r in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def balanced_partitions(lengths: Tensor, parts: int) -> list[Tensor]:
    """Indices for `parts` ranks with equal sample counts (to within one) and token totals as
    close as a greedy pass gets: longest sample first, each into the open rank with fewest tokens.
    Each rank's indices are returned sorted, so its samples keep their batch order."""
    capacity = [len(lengths) // parts + (1 if r < len(lengths) % parts else 0) for r in range(parts)]
    tokens = [0] * parts
    chosen: list[list[int]] = [[] for _ in range(parts)]
    for i in torch.argsort(lengths, descending=True, stable=True).tolist():
        rank = min((r for r in range(parts) if len(chosen[r]) < capacity[r]), key=lambda r: tokens[r])
        chosen[rank].append(i)
        tokens[rank] += int(lengths[i])
    return [torch.tensor(sorted(c), dtype=torch.long) for c in chosen]


def sample_tokens(batch: RolloutBatch) -> Tensor:                           # [N]
    return batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)


def shard_batch(batch: RolloutBatch, parts: int) -> tuple[list[Tensor], list[RolloutBatch]]:
    """(each rank's sample indices, each rank's part). Parts are token-balanced and of equal size:
    a part one short gets a copy of a sample with its response masked out, which adds nothing to
    any loss or count but keeps the ranks' forward passes in step."""
    if parts == 1:
        return [torch.arange(len(batch))], [batch]
    index = balanced_partitions(sample_tokens(batch), parts)
    size = max(len(i) for i in index)
    return index, [pad_with_masked(batch.select(i), size) for i in index]


def unshard_rows(index: list[Tensor], results: list[Tensor]) -> Tensor:
    """Per-rank results [part, ...] back into batch order [N, ...]; padding rows are dropped."""
    if len(results) == 1:  # one worker: already in order
        return results[0]
    n = sum(len(i) for i in index)
    out = results[0].new_zeros((n, *results[0].shape[1:]))
    for rows, result in zip(index, results):
        out[rows] = result[:len(rows)]
    return out


def pad_with_masked(batch: RolloutBatch, size: int) -> RolloutBatch:
    missing = size - len(batch)
    if missing == 0:
        return batch
    return concat_rows([batch, batch.masked_copies(missing)], pad_id=0)  # same widths: nothing is padded


def concat_rows(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Batches with the same prompt width stacked; responses right-padded to the widest."""
    width = max(b.response_ids.shape[1] for b in batches)
    fields = {}
    for f in dataclasses.fields(RolloutBatch):
        values = [getattr(b, f.name) for b in batches]
        if values[0] is None:
            fields[f.name] = None
        elif isinstance(values[0], list):
            fields[f.name] = [v for value in values for v in value]
        elif values[0].dim() == 2 and f.name not in ("prompt_ids", "prompt_mask"):
            fill = pad_id if f.name == "response_ids" else 0
            fields[f.name] = torch.cat([torch.nn.functional.pad(v, (0, width - v.shape[1]), value=fill)
                                        for v in values])
        else:
            fields[f.name] = torch.cat(values)
    return RolloutBatch(**fields)

