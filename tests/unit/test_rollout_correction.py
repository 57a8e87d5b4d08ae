"""Rollout correction's numbers: truncated IS weights, rejection filters, their parsing, and the
policy loss they re-weight."""

import math

import pytest
import torch

from keel.algorithms.losses import PolicyLossParams, compute_policy_loss
from keel.algorithms.rollout_correction import CorrectionParams, compute_correction, parse_rejection

MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
# log pi_train - log pi_rollout per token: the ratios e^0.5, 1, e^-0.1 | e^1.5, e^-2
# padding holds garbage
LOG_RATIO = torch.tensor([[0.5, 0.0, -0.1, 9.0], [1.5, -2.0, 7.0, 7.0]])


def correct(p: CorrectionParams, log_ratio=LOG_RATIO, mask=MASK):
    rollout = torch.full_like(log_ratio, -1.0)
    return compute_correction(rollout + log_ratio, rollout, mask, p)


def test_token_weights_are_the_ratio_truncated_and_zero_on_padding():
    weights = correct(CorrectionParams("token", is_threshold=2.0)).weights
    expected = torch.tensor(
        [[math.exp(0.5), 1.0, math.exp(-0.1), 0.0], [2.0, math.exp(-2.0), 0.0, 0.0]]
    )
    torch.testing.assert_close(weights, expected)


def test_sequence_weights_are_the_product_of_the_ratios_on_every_token():
    weights = correct(CorrectionParams("sequence", is_threshold=5.0)).weights
    first, second = math.exp(0.5 + 0.0 - 0.1), min(math.exp(1.5 - 2.0), 5.0)
    torch.testing.assert_close(
        weights, torch.tensor([[first] * 3 + [0.0], [second] * 2 + [0.0, 0.0]])
    )


def test_batch_normalized_weights_average_one():
    token = correct(CorrectionParams("token", is_threshold=2.0, is_batch_normalize=True)).weights
    assert (token * MASK).sum() / MASK.sum() == pytest.approx(1.0)
    seq = correct(CorrectionParams("sequence", is_threshold=5.0, is_batch_normalize=True)).weights
    assert seq[:, 0].mean() == pytest.approx(1.0)


def test_metrics_measure_the_mismatch_before_truncation():
    metrics = correct(CorrectionParams("token", is_threshold=2.0)).metrics
    valid = LOG_RATIO[MASK.bool()]
    assert metrics["rollout_corr/kl"].item() == pytest.approx(-valid.mean().item())
    assert metrics["rollout_corr/chi2_token"].item() == pytest.approx(
        torch.exp(2 * valid).mean().item() - 1
    )
    assert metrics["rollout_corr/rollout_is_mean"].item() == pytest.approx(
        torch.exp(valid).mean().item()
    )
    # e^1.5 only
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"].item() == pytest.approx(1 / 5)


def test_token_k1_keeps_the_ratio_band():
    keep = correct(CorrectionParams(rejection=parse_rejection("token_k1", "2.0"))).keep
    # ratios e^0.5 (1.65), 1, e^-0.1 kept; e^1.5 (4.5) and e^-2 (0.14) outside [0.5, 2]
    assert (keep * MASK).tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]
    lopsided = correct(CorrectionParams(rejection=parse_rejection("token_k1", "0.5_0.8"))).keep
    # k1 bounds pi_rollout / pi_train, as verl reads them: only e^-0.5 = 0.61 is inside [0.5, 0.8]
    assert (lopsided * MASK)[0].tolist() == [1, 0, 0, 0]


def test_sequence_filters_drop_whole_sequences():
    mean_k3 = correct(CorrectionParams(rejection=parse_rejection("seq_mean_k3", "0.1"))).keep
    assert (mean_k3 * MASK).tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]
    # 2^2/2 = 2 > 1.5
    max_k2 = correct(CorrectionParams(rejection=parse_rejection("seq_max_k2", "1.5"))).keep
    assert (max_k2 * MASK).tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]
    both = correct(CorrectionParams(rejection=parse_rejection("token_k2,seq_sum_k1", "0.2,3"))).keep
    # token_k2 keeps 0.5 (k2 0.125) and drops 1.5, -2; seq_sum_k1 keeps sums in [-log 3, log 3]
    assert (both * MASK).tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]
    metrics = correct(CorrectionParams(rejection=parse_rejection("seq_mean_k3", "0.1"))).metrics
    assert metrics["rollout_corr/rollout_rs_masked_fraction"].item() == pytest.approx(2 / 5)


def test_garbage_log_probs_give_finite_weights_and_rejection():
    """A sampler out of sync (or hostile numbers) can give log-ratios of thousands: the weights
    stay finite, the filters reject, nothing becomes nan."""
    wild = torch.tensor([[1000.0, -1000.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    result = correct(
        CorrectionParams("sequence", 2.0, rejection=parse_rejection("token_k3", "10")), wild
    )
    assert torch.isfinite(result.weights).all() and result.weights.max() <= 2.0
    assert (result.keep * MASK)[0].tolist() == [0, 0, 1, 0]
    assert all(torch.isfinite(v) for v in result.metrics.values())


def test_nan_and_inf_log_probs_never_reach_a_weight():
    """-inf or nan on padding (an engine's filler) changes nothing; nan on a real token is
    rejected by any filter, and its weight is 0, not nan (a loss multiplies it by the mask)."""
    train, rollout = torch.full((2, 4), -1.0), torch.full((2, 4), -1.0)
    train[0, 3], rollout[1, 2], rollout[1, 3] = float("-inf"), float("nan"), float("-inf")
    clean = compute_correction(train, rollout, MASK, CorrectionParams("sequence", 2.0))
    torch.testing.assert_close(clean.weights, MASK)
    assert all(torch.isfinite(v) for v in clean.metrics.values())
    train[0, 1] = float("nan")
    rejected = compute_correction(
        train,
        rollout,
        MASK,
        CorrectionParams("token", 2.0, rejection=parse_rejection("token_k3", "1")),
    )
    assert rejected.keep[0].tolist()[:3] == [1, 0, 1] and rejected.weights[0, 1] == 0


@pytest.mark.parametrize(
    "rs, threshold, words",
    [
        ("token_k4", "1", "not among"),
        ("token_k1", None, "rollout_rs_threshold is not"),
        ("token_k1,seq_mean_k3", "1,2,3", "3 thresholds for 2"),
        ("token_k1", "2_0.5", "lower bound exceeds"),
        ("seq_mean_k3", "0.1_0.2", "not a number"),
        ("token_k2", "-1", "must be positive"),
        (" , ", "1", "no option"),
    ],
)
def test_malformed_rejection_is_refused(rs, threshold, words):
    with pytest.raises(ValueError, match=words):
        parse_rejection(rs, threshold)


def test_is_weights_reweight_every_policy_loss():
    torch.manual_seed(0)
    old, new, adv = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    weights = torch.rand(2, 4)
    p = PolicyLossParams()
    for mode in ("vanilla", "gspo", "gpg", "cispo"):
        plain, _ = compute_policy_loss(mode, old, new, adv, MASK, p)
        ones, _ = compute_policy_loss(mode, old, new, adv, MASK, p, is_weights=torch.ones(2, 4))
        weighted, _ = compute_policy_loss(mode, old, new, adv, MASK, p, is_weights=weights)
        assert ones.item() == pytest.approx(plain.item()) and weighted.item() != pytest.approx(
            plain.item()
        ), mode
    # vanilla by hand: -A w min-clipped ratio, token-mean
    ratio = torch.exp(new - old)
    losses = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    losses = torch.where(adv < 0, torch.minimum(losses, -adv * 3.0), losses)
    expected = (losses * weights * MASK).sum() / MASK.sum()
    got, _ = compute_policy_loss("vanilla", old, new, adv, MASK, p, is_weights=weights)
    assert got.item() == pytest.approx(expected.item())
