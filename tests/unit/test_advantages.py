"""Advantage estimators and masked helpers against numbers worked out by hand."""

import pytest
import torch

from keel.algorithms.advantages import (
    ADV_ESTIMATORS,
    AdvantageInputs,
    AdvantageParams,
    compute_advantage,
)
from keel.algorithms.utils import masked_mean, masked_sum, masked_var, masked_whiten

ATOL = 1e-5


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def assert_close(actual, expected):
    torch.testing.assert_close(actual, t(expected), atol=ATOL, rtol=0)


def assert_zero_on_padding(mask, *tensors):
    for x in tensors:
        assert (x[mask == 0] == 0).all(), x


# --- masked helpers --------------------------------------------------------------------------


def test_masked_sum_and_mean():
    x = t([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    mask = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    # 1 + 2 + 4
    assert masked_sum(x, mask).item() == pytest.approx(7.0)
    # (1 + 2 + 4) / 3
    assert masked_mean(x, mask).item() == pytest.approx(7 / 3)
    # rows: (1 + 2) / 2 = 1.5; 4 / 1 = 4; an all-padding row gives 0, not nan
    assert_close(masked_mean(x, mask, dim=-1), [1.5, 4.0, 0.0])
    assert_close(masked_sum(x, mask.bool(), dim=-1), [3.0, 4.0, 0.0])


def test_masked_var_and_whiten():
    x = t([[1, 2, 3, 100]])
    mask = t([[1, 1, 1, 0]])
    # masked mean 2; squared deviations 1, 0, 1 -> sum 2; unbiased 2 / (3 - 1) = 1, biased 2 / 3
    assert masked_var(x, mask).item() == pytest.approx(1.0)
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(2 / 3)
    # (x - 2) / sqrt(1) on the valid positions; 100 is padding and does not enter the statistics
    assert_close(masked_whiten(x, mask)[:, :3], [[-1.0, 0.0, 1.0]])
    # shift_mean=False adds the mean 2 back: [1, 2, 3]
    assert_close(masked_whiten(x, mask, shift_mean=False)[:, :3], [[1.0, 2.0, 3.0]])


def test_one_element_has_zero_variance_and_whitens_to_zero_not_nan():
    assert masked_var(t([[5.0, 0.0]]), t([[1, 0]])).item() == 0.0
    # (5 - 5) * rsqrt(0 + 1e-8)
    assert masked_whiten(t([[5.0, 0.0]]), t([[1, 0]]))[0, 0].item() == 0.0


# --- shared batch for the group estimators -----------------------------------------------------
# B=4, T=3, right-padded. Group 7 = rows 0, 1, 2 (scores 1, 0, 0); group 3 = row 3 alone.
MASK = t([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0]])
# row 3 scores 0.25 + 0.25 = 0.5
REWARDS = t([[0, 0, 1], [0, 0, 0], [0, 0, 0], [0.25, 0.25, 0]])
GROUPS = torch.tensor([7, 7, 7, 3])


def group_inputs():
    return AdvantageInputs(
        token_level_rewards=REWARDS.clone(), response_mask=MASK.clone(), group_index=GROUPS
    )


def test_grpo():
    adv, ret = compute_advantage("grpo", group_inputs(), AdvantageParams())
    # group 7 {1, 0, 0}: mean 1/3; squared deviations 4/9 + 1/9 + 1/9 = 2/3, / (3 - 1) = 1/3,
    #   std sqrt(1/3) = 0.57735 -> (1 - 1/3) / 0.57735 = 1.15470; (0 - 1/3) / 0.57735 = -0.57735
    # group 3 {0.5}: size 1 -> mean 0, std 1 -> 0.5 / (1 + 1e-6) = 0.5
    expected = [
        [1.15470, 1.15470, 1.15470],
        [-0.57735, -0.57735, 0],
        [-0.57735, 0, 0],
        [0.5, 0.5, 0],
    ]
    assert_close(adv, expected)
    assert_close(ret, expected)
    assert_zero_on_padding(MASK, adv, ret)


def test_grpo_group_of_two():
    inp = AdvantageInputs(
        token_level_rewards=t([[0, 1], [0, 0]]),
        response_mask=t([[1, 1], [1, 0]]),
        group_index=torch.tensor([0, 0]),
    )
    adv, _ = compute_advantage("grpo", inp, AdvantageParams())
    # group {1, 0}: mean 0.5, std sqrt(0.5) = 0.70711 -> (1 - 0.5) / 0.70711 = 0.70711, and -0.70711
    assert_close(adv, [[0.70711, 0.70711], [-0.70711, 0]])


def test_grpo_without_std_is_dr_grpo():
    adv, _ = compute_advantage(
        "grpo", group_inputs(), AdvantageParams(norm_adv_by_std_in_grpo=False)
    )
    # group 7: 1 - 1/3 = 0.66667, 0 - 1/3 = -0.33333; group 3 (size 1, mean 0): 0.5
    assert_close(
        adv, [[0.66667, 0.66667, 0.66667], [-0.33333, -0.33333, 0], [-0.33333, 0, 0], [0.5, 0.5, 0]]
    )


def test_rloo():
    adv, ret = compute_advantage("rloo", group_inputs(), AdvantageParams())
    # group 7 {1, 0, 0}: row 0: 1 - mean(0, 0) = 1; rows 1, 2: 0 - mean(1, 0) = -0.5
    # group 3 {0.5}: nobody else -> baseline 0 -> 0.5
    expected = [[1, 1, 1], [-0.5, -0.5, 0], [-0.5, 0, 0], [0.5, 0.5, 0]]
    assert_close(adv, expected)
    assert_close(ret, expected)
    assert_zero_on_padding(MASK, adv, ret)


def test_reinforce_plus_plus_baseline():
    adv, ret = compute_advantage("reinforce_plus_plus_baseline", group_inputs(), AdvantageParams())
    # minus group mean: row 0: 1 - 1/3 = 2/3; rows 1, 2: -1/3; row 3 (size 1, mean 0): 0.5
    # over the 8 valid tokens (3, 2, 1, 2 per row): sum 3*(2/3) + 3*(-1/3) + 2*0.5 = 2, mean 0.25
    # deviations 5/12 (x3), -7/12 (x3), 1/4 (x2); squares 75/144 + 147/144 + 18/144 = 5/3
    # unbiased var (5/3) / 7 = 5/21, std 0.48795
    # -> 0.41667 / 0.48795 = 0.85391; -0.58333 / 0.48795 = -1.19548; 0.25 / 0.48795 = 0.51235
    expected = [
        [0.85391, 0.85391, 0.85391],
        [-1.19548, -1.19548, 0],
        [-1.19548, 0, 0],
        [0.51235, 0.51235, 0],
    ]
    assert_close(adv, expected)
    assert_close(ret, expected)
    assert_zero_on_padding(MASK, adv, ret)


def test_reinforce_plus_plus_discounts_and_resets_at_padding():
    mask = t([[1, 1, 1], [1, 1, 0]])
    # row 1 holds a reward of 5 on its padded position: it must not flow into the response
    inp = AdvantageInputs(token_level_rewards=t([[0, 0, 1], [1, 2, 5]]), response_mask=mask)
    adv, ret = compute_advantage("reinforce_plus_plus", inp, AdvantageParams(gamma=0.5))
    # row 0: 1; 0 + 0.5 * 1 = 0.5; 0 + 0.5 * 0.5 = 0.25
    # row 1: padded 5 is cut off -> t=1: 2; t=0: 1 + 0.5 * 2 = 2 (3.25 had it leaked)
    assert_close(ret, [[0.25, 0.5, 1.0], [2.0, 2.0, 0.0]])
    # whiten 0.25, 0.5, 1, 2, 2: mean 5.75 / 5 = 1.15; deviations -0.9, -0.65, -0.15, 0.85, 0.85
    # squares 0.81 + 0.4225 + 0.0225 + 0.7225 + 0.7225 = 2.7; var 2.7 / 4 = 0.675, std 0.82158 ->
    # -0.9 / 0.82158 = -1.09545; -0.65 / .. = -0.79115; -0.15 / .. = -0.18257; 0.85 / .. = 1.03459
    assert_close(adv, [[-1.09545, -0.79115, -0.18257], [1.03459, 1.03459, 0.0]])
    assert_zero_on_padding(mask, adv, ret)


def test_remax():
    mask = t([[1, 1, 1], [1, 1, 0]])
    inp = AdvantageInputs(
        token_level_rewards=t([[0, 0, 1], [0, 0.5, 0]]),
        response_mask=mask,
        baseline_rewards=t([0.25, 1.0]),
    )
    adv, ret = compute_advantage("remax", inp, AdvantageParams())
    # returns = reward-to-go: row 0 [1, 1, 1]; row 1 [0.5, 0.5, 0]
    assert_close(ret, [[1, 1, 1], [0.5, 0.5, 0]])
    # minus the greedy baseline on valid tokens: 1 - 0.25 = 0.75; 0.5 - 1 = -0.5
    assert_close(adv, [[0.75, 0.75, 0.75], [-0.5, -0.5, 0]])
    assert_zero_on_padding(mask, adv, ret)


def test_gae():
    mask = t([[1, 1, 1], [1, 1, 0]])
    inp = AdvantageInputs(
        token_level_rewards=t([[0, 0, 1], [0, 1, 0]]),
        response_mask=mask,
        # 9.0 sits on padding and must be ignored
        values=t([[0.5, 0.5, 0.5], [0.2, 0.4, 9.0]]),
    )
    adv, ret = compute_advantage("gae", inp, AdvantageParams(gamma=1.0, lam=0.5))
    # row 0, delta_t = r_t + V_{t+1} - V_t, A_t = delta_t + 0.5 * A_{t+1}:
    #   t=2: 1 + 0 - 0.5 = 0.5; t=1: 0 + 0.5 - 0.5 + 0.5 * 0.5 = 0.25; t=0: 0 + 0.5 * 0.25 = 0.125
    # row 1 (t=2 padded: skipped, next value stays 0):
    #   t=1: 1 + 0 - 0.4 = 0.6; t=0: 0 + 0.4 - 0.2 + 0.5 * 0.6 = 0.5
    # returns = A + V: [0.625, 0.75, 1.0], [0.7, 1.0, pad]
    assert_close(ret, [[0.625, 0.75, 1.0], [0.7, 1.0, 0.0]])
    # whiten 0.125, 0.25, 0.5, 0.5, 0.6: mean 1.975 / 5 = 0.395; deviations -0.27, -0.145, 0.105,
    # 0.105, 0.205; squares sum 0.0729 + 0.021025 + 2 * 0.011025 + 0.042025 = 0.158;
    # var 0.158 / 4 = 0.0395, std 0.19875 -> -1.35852, -0.72957, 0.52831, 0.52831, 1.03147
    assert_close(adv, [[-1.35852, -0.72957, 0.52831], [0.52831, 1.03147, 0.0]])
    assert_zero_on_padding(mask, adv, ret)


def test_gae_carries_value_across_masked_middle_token():
    # a masked token inside the response (e.g. a tool observation) is skipped: V and A carry over it
    mask = t([[1, 0, 1]])
    inp = AdvantageInputs(
        token_level_rewards=t([[0, 0, 1]]), response_mask=mask, values=t([[0.5, 7.0, 0.5]])
    )
    _, ret = compute_advantage("gae", inp, AdvantageParams(gamma=1.0, lam=1.0))
    # t=2: delta 1 - 0.5 = 0.5, A = 0.5; t=1 masked: next V stays 0.5, A stays 0.5
    # t=0: delta 0 + 0.5 - 0.5 = 0, A = 0 + 0.5 = 0.5; returns A + V = 1.0 (7.0 never enters)
    assert_close(ret, [[1.0, 0.0, 1.0]])


def test_registry_flags():
    names = {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"}
    assert names <= set(ADV_ESTIMATORS)
    assert ADV_ESTIMATORS["gae"].needs_critic and not ADV_ESTIMATORS["gae"].needs_baseline
    assert ADV_ESTIMATORS["remax"].needs_baseline and not ADV_ESTIMATORS["remax"].needs_critic
    assert not ADV_ESTIMATORS["grpo"].needs_critic and not ADV_ESTIMATORS["grpo"].needs_baseline


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError, match="unknown advantage estimator 'gpro'") as err:
        compute_advantage("gpro", group_inputs(), AdvantageParams())
    assert "'grpo'" in str(err.value) and "'gae'" in str(err.value)


@pytest.mark.parametrize(
    "name, missing",
    [
        ("gae", "values"),
        ("grpo", "group_index"),
        ("rloo", "group_index"),
        ("remax", "baseline_rewards"),
    ],
)
def test_missing_input_raises(name, missing):
    inp = AdvantageInputs(token_level_rewards=REWARDS, response_mask=MASK)
    with pytest.raises(ValueError, match=missing):
        compute_advantage(name, inp, AdvantageParams())


def without_columns(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Each row's kept positions, left-aligned and right-padded with zeros: the span cut out."""
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        kept = x[row][keep[row]]
        out[row, : len(kept)] = kept
    return out


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_a_masked_span_inside_a_response_counts_as_absent(name):
    """Multi-turn: a tool's output between two assistant turns is masked. Every estimator gives
    the turns around it the advantages they get with the span cut out, and 0 on the span: the
    first turn is credited with the final reward (REINFORCE++ used to give it 0)."""
    generator = torch.Generator().manual_seed(0)
    mask = t(
        [
            [1, 1, 0, 0, 0, 1, 1, 0],
            [1, 1, 1, 1, 1, 1, 0, 0],
            [1, 0, 0, 1, 1, 1, 1, 1],
            [1, 1, 1, 1, 1, 1, 1, 1],
        ]
    )
    lengths = mask.sum(-1).long()
    # the last generated token of each row
    last = torch.tensor([6, 5, 7, 7])
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(4), last] = torch.randn(4, generator=generator)
    values = torch.randn(mask.shape, generator=generator) * mask
    groups = torch.tensor([0, 0, 1, 1])
    spanned = AdvantageInputs(
        rewards, mask, groups, values, baseline_rewards=t([0.1, -0.2, 0.3, 0.0])
    )
    keep = mask.bool()
    cut_mask = (torch.arange(8)[None] < lengths[:, None]).float()
    cut = AdvantageInputs(
        without_columns(rewards, keep),
        cut_mask,
        groups,
        without_columns(values, keep),
        baseline_rewards=spanned.baseline_rewards,
    )
    params = AdvantageParams(gamma=0.9, lam=0.95)
    adv, ret = compute_advantage(name, spanned, params)
    cut_adv, cut_ret = compute_advantage(name, cut, params)
    assert_zero_on_padding(mask, adv, ret)
    torch.testing.assert_close(without_columns(adv, keep), cut_adv, atol=ATOL, rtol=0)
    torch.testing.assert_close(without_columns(ret, keep), cut_ret, atol=ATOL, rtol=0)
    # the turn before the tool's output is credited
    assert adv[0, :2].abs().sum() > 0
