"""DAPO's dynamic sampling (algorithm.filter_groups): generate, score, keep the prompts whose
samples did not all score alike, and go on with more prompts until data.train_batch_size of them
remain."""

from __future__ import annotations

import dataclasses
import logging

import torch

from keel.algorithms.groups import groups_with_signal
from keel.errors import FILTER_GROUPS_EXHAUSTED, TOO_MANY_NOT_SCORED, KeelError
from keel.errors.fixes import setting
from keel.training.batching import concat_rows
from keel.types import ScoredBatch

log = logging.getLogger("keel")


def signal_values(batch: ScoredBatch, metric: str) -> torch.Tensor:
    """[N] what must differ within a group: `acc` from the reward function's dict results (the
    score where there is none), else the score."""
    if (
        metric == "acc"
        and batch.reward_extras
        and all("acc" in extra for extra in batch.reward_extras)
    ):
        return torch.tensor([float(extra["acc"]) for extra in batch.reward_extras])
    return batch.scores


# calls that replacing short groups alone may take before the step trains fewer
REFILL_CALLS = 8

# past any dataset's row indices
GROUP_ID_STRIDE = 1 << 40


def _more_batches_fix(groups: int, calls: int, prompts_wanted: int) -> str | None:
    """Twice the generation batches this share of prompts with a signal needs; None when no prompt
    had one (more batches of the same would not either: the scorer or the data is the fix)."""
    if not groups:
        return None
    needed = -(-prompts_wanted * calls // groups)
    return (
        f"set {setting('algorithm.filter_groups.max_num_gen_batches', 2 * needed)} (twice the "
        f"{needed} batches {groups} prompts with a signal in {calls} suggest)"
    )


def fill_with_signal(
    next_scored_batch,
    prompts_wanted: int,
    metric: str | None,
    max_batches: int,
    pad_token_id: int,
    whole: int = 0,
) -> tuple[ScoredBatch, dict[str, float]]:
    """`next_scored_batch(call, groups wanted)` -> a generated, scored batch, called until
    `prompts_wanted` groups are kept (or `max_batches` calls, 0 for no limit). Kept: with `metric`,
    DAPO's rule, groups whose samples did not all score alike (each call a whole batch); with
    `whole` (partial rollouts, whose rounds give a few more groups cheaply), only groups with all
    `whole` samples scored, so a group that reward.on_error=mask left short is replaced (each call
    asking for the groups still wanted). The batch holds exactly that many groups, each with all its
    kept samples, in the order they came. Replacing short groups gives up after REFILL_CALLS calls
    and trains short ones too, as a sync step does (a scorer failing some sample of every group)."""
    kept: list[ScoredBatch] = []
    # groups a failed scoring left short: what giving up trains
    short: list[ScoredBatch] = []
    groups = generated = calls = 0
    while groups < prompts_wanted:
        if metric is None and calls >= REFILL_CALLS:
            kept, groups = _with_short_groups(kept, short, groups, prompts_wanted, calls)
            break
        if max_batches and calls >= max_batches:
            raise KeelError(
                FILTER_GROUPS_EXHAUSTED,
                f"{groups} of {prompts_wanted} prompts had samples that scored "
                f"differently after {calls} generation batches (algorithm.filter_groups."
                f"max_num_gen_batches={max_batches}, metric {metric})",
                _more_batches_fix(groups, calls, prompts_wanted),
            )
        batch = _apart(
            next_scored_batch(calls, prompts_wanted if metric else prompts_wanted - groups), calls
        )
        calls += 1
        generated += int(torch.unique(batch.group_index).numel())
        keep, whole_rows = _kept_rows(batch, metric, whole)
        if (keep & whole_rows).any():
            kept.append(batch.select((keep & whole_rows).nonzero().squeeze(-1)))
            groups += int(torch.unique(kept[-1].group_index).numel())
        if (keep & ~whole_rows).any():
            short.append(batch.select((keep & ~whole_rows).nonzero().squeeze(-1)))
    batch = concat_rows(kept, pad_token_id)
    # whole groups, in order
    first = list(dict.fromkeys(batch.group_index.tolist()))[:prompts_wanted]
    batch = batch.select(torch.isin(batch.group_index, torch.tensor(first)).nonzero().squeeze(-1))
    return batch, {"gen_batches": float(calls), "kept_prompt_ratio": groups / max(generated, 1)}


def _apart(batch: ScoredBatch, calls: int) -> ScoredBatch:
    """A prompt drawn again in a later generation batch (an epoch boundary) is another group; a
    sample trained as segments, another sample."""
    offset = calls * GROUP_ID_STRIDE
    segments = None if batch.sample_index is None else batch.sample_index + offset
    return dataclasses.replace(batch, group_index=batch.group_index + offset, sample_index=segments)


def _with_short_groups(
    kept: list, short: list, groups: int, wanted: int, calls: int
) -> tuple[list, int]:
    """Giving up on whole groups: the short ones fill the batch, as in a sync step."""
    log.warning(
        "%d of %d groups scored whole after %d rounds: the step trains groups a failed "
        "scoring left short too",
        groups,
        wanted,
        calls,
    )
    kept = kept + short
    groups = len({g for b in kept for g in b.group_index.tolist()})
    if not groups:
        raise KeelError(
            TOO_MANY_NOT_SCORED,
            f"no sample of {calls} rounds of generation could be scored",
            "fix the scorer for the reason in reward/not_scored/* (samples.jsonl shows the "
            "responses)",
        )
    return kept, groups


def _kept_rows(
    batch: ScoredBatch, metric: str | None, whole: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] bool the rows of groups with a signal (all, without `metric`), [N] bool those of whole
    groups)."""
    keep = torch.ones(len(batch), dtype=torch.bool)
    if metric is not None:
        keep &= groups_with_signal(signal_values(batch, metric), batch.group_index)
    if not whole:
        return keep, torch.ones_like(keep)
    _, of, counts = torch.unique(batch.group_index, return_inverse=True, return_counts=True)
    return keep, counts[of] == whole
