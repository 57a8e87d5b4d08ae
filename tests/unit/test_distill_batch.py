"""The distillation fields of the step's records: which log-probs stand for the student's before
the update, and the teacher's [N, R, k] top-k fields kept aligned with their rows and tokens when
batches are trimmed, stacked, cut into micro-batches and shared across ranks."""

import dataclasses

import pytest
import torch

from keel.trainer.train_batch import OldLogProbs, student_log_probs
from keel.training.batching import MicroBatching, concat_rows, micro_batches, shard_batch
from keel.types import TrainBatch, trim_padding

from tests_helpers import make_batch

K = 3


# --- the student's log-probs ----------------------------------------------------------------


def scored_with_sampler_log_probs():
    batch = make_batch([3, 2, 4], width=4)
    # the sampler's: -1 - row / 10; the old-log-prob pass's: -5 - row / 10
    sampler = -1.0 - torch.arange(3.0)[:, None].expand(3, 4) / 10
    return dataclasses.replace(batch, sampling_log_probs=sampler.clone()), sampler - 4.0


def test_on_policy_the_student_is_the_sampler():
    batch, _ = scored_with_sampler_log_probs()
    old = OldLogProbs(values=None, own=None, measured_in_update=True)
    assert torch.equal(student_log_probs(batch, old), batch.sampling_log_probs)


def test_after_the_old_log_prob_pass_the_student_is_that_pass():
    batch, recomputed = scored_with_sampler_log_probs()
    old = OldLogProbs(values=recomputed, own=None, measured_in_update=False)
    assert torch.equal(student_log_probs(batch, old), recomputed)


def test_the_first_mini_batchs_own_rows_take_the_samplers_log_probs():
    batch, recomputed = scored_with_sampler_log_probs()
    own = torch.tensor([True, False, True])
    # the pass left 0 on the rows it skipped
    values = recomputed * (~own)[:, None]
    old = OldLogProbs(values=values, own=own, measured_in_update=False)
    got = student_log_probs(batch, old)
    assert torch.equal(got[0], batch.sampling_log_probs[0])
    assert torch.equal(got[2], batch.sampling_log_probs[2])
    assert torch.equal(got[1], recomputed[1])
    # no row keeps the pass's 0s
    assert (got < 0).all()


# --- [N, R, k] fields -----------------------------------------------------------------------


def with_top_k(lengths: list[int], width: int, first_id: int = 0) -> TrainBatch:
    """A batch whose teacher fields encode where they come from: top id = 100 x row + 10 x position
    + j (offset by first_id), its log-prob minus that; 0 past each response, as the teacher
    leaves them."""
    batch = make_batch(lengths, width)
    n = len(lengths)
    code = (
        100 * torch.arange(n)[:, None, None]
        + 10 * torch.arange(width)[None, :, None]
        + torch.arange(K)[None, None, :]
        + first_id
    )
    mask = batch.response_mask[..., None]
    return dataclasses.replace(
        batch,
        teacher_log_probs=-batch.response_mask.float(),
        teacher_top_ids=code * mask,
        teacher_top_log_probs=-code.float() * mask,
    )


def assert_aligned(batch: TrainBatch, source: TrainBatch, rows: list[int]) -> None:
    """Each of batch's rows holds source's row's teacher fields on its real tokens, 0 past them."""
    width = batch.response_ids.shape[1]
    assert batch.teacher_top_ids.shape == batch.teacher_top_log_probs.shape == (len(rows), width, K)
    for i, row in enumerate(rows):
        length = int(source.response_mask[row].sum())
        assert int(batch.response_mask[i].sum()) == length
        assert torch.equal(batch.teacher_top_ids[i, :length], source.teacher_top_ids[row, :length])
        assert torch.equal(
            batch.teacher_top_log_probs[i, :length], source.teacher_top_log_probs[row, :length]
        )
        assert (batch.teacher_top_ids[i, length:] == 0).all()
        assert (batch.teacher_top_log_probs[i, length:] == 0).all()


def test_trim_padding_cuts_top_k_fields_on_the_response_dimension():
    batch = with_top_k([2, 3], width=6)
    small = trim_padding(batch)
    # longest response: 3
    assert small.response_ids.shape == (2, 3)
    assert small.teacher_log_probs.shape == (2, 3)
    assert_aligned(small, batch, [0, 1])


def test_concat_rows_pads_top_k_fields_on_the_response_dimension():
    narrow, wide = with_top_k([1, 2], width=2), with_top_k([4, 1, 3], width=4, first_id=7)
    stacked = concat_rows([narrow, wide], pad_id=0)
    assert stacked.response_ids.shape == (5, 4)
    assert stacked.teacher_log_probs.shape == (5, 4)
    assert_aligned(stacked.select([0, 1]), narrow, [0, 1])
    assert_aligned(stacked.select([2, 3, 4]), wide, [0, 1, 2])


@pytest.mark.parametrize("how", [MicroBatching(2), MicroBatching(8, max_tokens=12)])
def test_micro_batches_keep_top_k_fields_with_their_rows(how):
    batch = with_top_k([5, 1, 3, 2, 4], width=6)
    seen = []
    for rows, micro in micro_batches(batch, how):
        assert_aligned(micro, batch, rows.tolist())
        seen += rows.tolist()
    assert sorted(seen) == list(range(5))


def test_shards_filled_with_masked_copies_keep_top_k_fields_aligned():
    batch = with_top_k([5, 1, 3], width=6)
    index, parts = shard_batch(batch, 2)
    for rows, part in zip(index, parts):
        assert part.teacher_top_ids.shape[1:] == (6, K)
        real = part.select(list(range(len(rows))))
        assert_aligned(real, batch, rows.tolist())
