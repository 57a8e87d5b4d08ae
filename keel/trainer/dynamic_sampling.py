"""DAPO's dynamic sampling (algorithm.filter_groups): generate, score, keep the prompts whose samples
did not all score alike, and go on with more prompts until data.train_batch_size of them remain."""

from __future__ import annotations

import torch

from keel.algorithms.groups import groups_with_signal
from keel.errors import FILTER_GROUPS_EXHAUSTED, KeelError
from keel.errors.fixes import setting
from keel.training.batching import concat_rows
from keel.types import ScoredBatch


def signal_values(batch: ScoredBatch, metric: str) -> torch.Tensor:
    """[N] what must differ within a group: `acc` from the reward function's dict results (the
    score where there is none), else the score."""
    if metric == "acc" and batch.reward_extras and all("acc" in extra for extra in batch.reward_extras):
        return torch.tensor([float(extra["acc"]) for extra in batch.reward_extras])
    return batch.scores


GROUP_ID_STRIDE = 1 << 40  # past any dataset's row indices


def _more_batches_fix(groups: int, calls: int, prompts_wanted: int) -> str | None:
    """Twice the generation batches this share of prompts with a signal needs; None when no prompt had
    one (more batches of the same would not either: the scorer or the data is the fix)."""
    if not groups:
        return None
    needed = -(-prompts_wanted * calls // groups)
    return (
        f"set {setting('algorithm.filter_groups.max_num_gen_batches', 2 * needed)} (twice the {needed} batches "
        f"{groups} prompts with a signal in {calls} suggest)"
    )


def fill_with_signal(
    next_scored_batch, prompts_wanted: int, metric: str, max_batches: int, pad_token_id: int
) -> tuple[ScoredBatch, dict[str, float]]:
    """`next_scored_batch(call)` -> a generated, scored batch, called until `prompts_wanted` prompts
    with a signal are kept (or `max_batches` calls, 0 for no limit). The batch holds exactly that
    many prompts, each with all its kept samples, in the order they came."""
    kept: list[ScoredBatch] = []
    groups = generated = calls = 0
    while groups < prompts_wanted:
        if max_batches and calls >= max_batches:
            raise KeelError(
                FILTER_GROUPS_EXHAUSTED,
                f"{groups} of {prompts_wanted} prompts had samples that scored "
                f"differently after {calls} generation batches (algorithm.filter_groups."
                f"max_num_gen_batches={max_batches}, metric {metric})",
                _more_batches_fix(groups, calls, prompts_wanted),
            )
        batch = next_scored_batch(calls)
        # A prompt drawn again in a later generation batch (an epoch boundary) is another group.
        batch.group_index = batch.group_index + calls * GROUP_ID_STRIDE
        if batch.sample_index is not None:  # samples trained as segments: theirs too
            batch.sample_index = batch.sample_index + calls * GROUP_ID_STRIDE
        calls += 1
        generated += int(torch.unique(batch.group_index).numel())
        keep = groups_with_signal(signal_values(batch, metric), batch.group_index)
        if keep.any():
            kept.append(batch.select(keep.nonzero().squeeze(-1)))
            groups += int(torch.unique(kept[-1].group_index).numel())
    batch = concat_rows(kept, pad_token_id)
    first = list(dict.fromkeys(batch.group_index.tolist()))[:prompts_wanted]  # whole groups, in order
    batch = batch.select(torch.isin(batch.group_index, torch.tensor(first)).nonzero().squeeze(-1))
    return batch, {
        "dynamic_sampling/gen_batches": float(calls),
        "dynamic_sampling/kept_prompt_ratio": groups / max(generated, 1),
    }
