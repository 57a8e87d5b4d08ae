"""Micro-batches by sample count or by token budget (use_dynamic_bsz)."""

import dataclasses

import torch

from keel.training.batching import MicroBatching, _split_to_count, micro_batches, token_budget_bins

from tests_helpers import make_batch


def test_token_budget_bins_stay_within_budget_and_cover_every_sample_once():
    prompts = torch.tensor([10, 3, 3, 7, 2, 9, 1, 4])
    responses = torch.tensor([5, 1, 2, 6, 1, 7, 1, 2])
    bins = token_budget_bins(prompts, responses, max_tokens=24)
    assert sorted(torch.cat(bins).tolist()) == list(range(8))
    for b in bins:
        assert len(b) * (int(prompts[b].max()) + int(responses[b].max())) <= 24
    # short samples share a pass
    assert len(bins) < 8
    # too long: alone
    assert [len(b) for b in token_budget_bins(prompts, responses, max_tokens=5)] == [1] * 8


def test_split_to_count_halves_the_largest_then_adds_fillers():
    split = _split_to_count([torch.tensor([0, 1, 2, 3]), torch.tensor([4])], 3)
    assert sorted(len(b) for b in split) == [1, 2, 2]
    assert [len(b) for b in _split_to_count([torch.tensor([0])], 2)] == [1, 0]


def test_dynamic_micro_batches_keep_every_sample_and_mask_fillers():
    batch = make_batch([1, 5, 2, 6, 3])
    parts = micro_batches(batch, MicroBatching(size=2, max_tokens=16))
    assert sorted(torch.cat([rows for rows, _ in parts]).tolist()) == [0, 1, 2, 3, 4]
    # each trimmed to its own widest sample
    for rows, micro in parts:
        assert micro.response_ids.shape[1] == int(batch.response_mask[rows].sum(-1).max())


def padded_tokens(parts) -> int:
    return sum(micro.prompt_ids.numel() + micro.response_ids.numel() for _, micro in parts)


def test_fixed_size_micro_batches_group_similar_lengths():
    # alternating: contiguous pairs would each pad to 6
    batch = make_batch([1, 6, 1, 6, 1, 6, 1, 6])
    parts = micro_batches(batch, MicroBatching(size=2))
    assert [len(rows) for rows, _ in parts] == [2, 2, 2, 2]
    assert sorted(torch.cat([rows for rows, _ in parts]).tolist()) == list(range(8))
    # every pair holds a 6-token response
    contiguous = 4 * 2 * (3 + 6)
    assert padded_tokens(parts) == 2 * 2 * (3 + 1) + 2 * 2 * (3 + 6) < contiguous


def test_rejected_tokens_leave_the_loss_denominators_and_the_fillers():
    """Rollout correction's rejection (rollout_keep): a mini-batch's token count is of the kept
    tokens, and a rank's masked filler keeps nothing."""
    from keel.training.batching import plan_minibatches

    batch = dataclasses.replace(
        make_batch([3, 5, 2, 6, 4]),
        advantages=torch.ones(5, 6),
        # column 1 rejected
        rollout_keep=torch.tensor([[1, 0, 1, 1, 1, 1]] * 5, dtype=torch.float),
    )
    ranks = plan_minibatches(
        batch, samples_per_mini=5, epochs=1, shuffle=False, seed=0, norm_length=None, world_size=2
    )
    # every response is long enough to lose one
    assert int(ranks[0][0].scale.tokens) == (3 + 5 + 2 + 6 + 4) - 5
    assert all(
        part.samples.loss_mask.sum() <= part.samples.response_mask.sum()
        for parts in ranks
        for part in parts
    )
    filler = batch.masked_copies(1)
    assert filler.loss_mask.sum() == 0
