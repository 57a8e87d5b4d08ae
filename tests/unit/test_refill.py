"""Partial rollouts replace groups that a failed scoring left short
(dynamic_sampling.fill_with_signal with `whole`): rounds ask for the groups still wanted; a scorer
that leaves some sample of every group unscored makes the step give up after REFILL_CALLS rounds and
train the short groups, as a sync step would; one that scores nothing is an error with its code."""

import dataclasses
import logging

import pytest
import torch

from keel.errors import TOO_MANY_NOT_SCORED, KeelError
from keel.trainer.dynamic_sampling import REFILL_CALLS, fill_with_signal
from keel.training.batching import concat_rows
from keel.types import ScoredBatch

from tests_helpers import make_batch

# samples per group
N = 4


def groups(first: int, count: int, kept_per_group: int) -> ScoredBatch:
    """`count` groups numbered from `first`, each with `kept_per_group` of its N samples left after
    scoring."""
    batch = make_batch([2] * (count * kept_per_group))
    return dataclasses.replace(
        batch,
        group_index=torch.arange(first, first + count).repeat_interleave(kept_per_group),
        scores=torch.ones(len(batch)),
    )


def rounds(kept_per_group):
    asked, drawn = [], [0]

    def next_round(call: int, wanted: int) -> ScoredBatch:
        asked.append(wanted)
        batch = groups(drawn[0], wanted, kept_per_group(call, wanted))
        drawn[0] += wanted
        return batch

    return next_round, asked


def test_short_groups_are_replaced_by_the_groups_still_wanted():
    """The first round's last two groups lost a sample each: the second round asks for two groups
    more."""
    next_round, asked = rounds(lambda call, wanted: N)

    def first_round_half_short(call: int, wanted: int) -> ScoredBatch:
        if call:
            return next_round(call, wanted)
        asked.append(wanted)
        return concat_rows([groups(0, 2, N), groups(2, 2, N - 1)], 0)

    batch, counts = fill_with_signal(first_round_half_short, 4, None, 0, 0, whole=N)
    assert asked == [4, 2]
    assert len(batch) == 4 * N and len(set(batch.group_index.tolist())) == 4
    assert counts["gen_batches"] == 2


def test_a_scorer_failing_in_every_group_trains_the_short_groups_after_the_last_round(caplog):
    next_round, asked = rounds(lambda call, wanted: N - 1)
    with caplog.at_level(logging.WARNING, logger="keel"):
        batch, counts = fill_with_signal(next_round, 4, None, 0, 0, whole=N)
    assert len(asked) == REFILL_CALLS and counts["gen_batches"] == REFILL_CALLS
    # short, as a sync step
    assert len(set(batch.group_index.tolist())) == 4 and len(batch) == 4 * (N - 1)
    assert "trains groups a failed scoring left short" in caplog.text


def test_a_scorer_that_scores_nothing_stops_the_run_with_its_code():
    next_round, _ = rounds(lambda call, wanted: 0)
    with pytest.raises(KeelError) as stopped:
        fill_with_signal(next_round, 4, None, 0, 0, whole=N)
    assert stopped.value.code == TOO_MANY_NOT_SCORED
