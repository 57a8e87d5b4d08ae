"""KL estimators, controllers and the in-reward penalty against numbers worked out by hand."""

import pytest
import torch

from keel.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
)

ATOL = 1e-5


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


# log_prob - ref_log_prob = [0.5, -1.0, 0.0]
LOG_PROB = t([[-1.0, -2.0, -0.5]])
REF_LOG_PROB = t([[-1.5, -1.0, -0.5]])


@pytest.mark.parametrize(
    "kind, expected",
    [
        # k1: lp - ref
        ("kl", [0.5, -1.0, 0.0]),
        # |lp - ref|
        ("abs", [0.5, 1.0, 0.0]),
        # k2: 0.5 * 0.25, 0.5 * 1, 0
        ("mse", [0.125, 0.5, 0.0]),
        # k3: kl = ref - lp = [-0.5, 1, 0]; exp(kl) - kl - 1:
        #   0.60653 + 0.5 - 1 = 0.10653; 2.71828 - 1 - 1 = 0.71828; 1 - 0 - 1 = 0
        ("low_var_kl", [0.10653, 0.71828, 0.0]),
    ],
)
def test_kl_estimators(kind, expected):
    torch.testing.assert_close(
        kl_penalty(LOG_PROB, REF_LOG_PROB, kind), t([expected]), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("alias, name", [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")])
def test_kl_aliases(alias, name):
    assert alias in KL_ESTIMATORS and name in KL_ESTIMATORS
    torch.testing.assert_close(
        kl_penalty(LOG_PROB, REF_LOG_PROB, alias), kl_penalty(LOG_PROB, REF_LOG_PROB, name)
    )


def test_low_var_kl_is_clamped():
    # ref - lp = 20: exp(20) - 21 ~ 4.9e8 -> 10; ref - lp = -20: exp(-20) + 20 - 1 ~ 19 -> 10
    out = kl_penalty(t([[0.0, 0.0]]), t([[20.0, -20.0]]), "low_var_kl")
    torch.testing.assert_close(out, t([[10.0, 10.0]]))


def test_unknown_kl_estimator_lists_valid_kinds():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'") as err:
        kl_penalty(LOG_PROB, REF_LOG_PROB, "k4")
    assert all(f"'{kind}'" in str(err.value) for kind in KL_ESTIMATORS)


def test_fixed_controller_never_moves():
    ctrl = FixedKLController(kl_coef=0.1)
    ctrl.update(current_kl=5.0, n_steps=100)
    assert ctrl.value == 0.1
    restored = FixedKLController(kl_coef=0.5)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == 0.1


def test_adaptive_controller():
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=100)
    # error 0.15 / 0.1 - 1 = 0.5, clipped to 0.2 -> x (1 + 0.2 * 10 / 100) = x 1.02 -> 0.204
    ctrl.update(current_kl=0.15, n_steps=10)
    assert ctrl.value == pytest.approx(0.204)
    # error 0.09 / 0.1 - 1 = -0.1 (inside the clip) -> x (1 - 0.1 * 50 / 100) = x 0.95 -> 0.1938
    ctrl.update(current_kl=0.09, n_steps=50)
    assert ctrl.value == pytest.approx(0.1938)

    restored = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=100)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == pytest.approx(0.1938)
    # both continue identically: error clipped to -0.2 -> x (1 - 0.2 * 100 / 100) = x 0.8 -> 0.15504
    for c in (ctrl, restored):
        c.update(current_kl=0.0, n_steps=100)
        assert c.value == pytest.approx(0.15504)


def test_make_kl_controller():
    assert isinstance(make_kl_controller("fixed", kl_coef=0.1), FixedKLController)
    adaptive = make_kl_controller("adaptive", kl_coef=0.3, target_kl=0.05, horizon=500)
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.3, 0.05, 500)
    with pytest.raises(ValueError, match="'fixed', 'adaptive'"):
        make_kl_controller("pid", kl_coef=0.1)
    with pytest.raises(ValueError, match="horizon > 0"):
        make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.1, horizon=0)


def test_apply_kl_penalty():
    mask = t([[1, 1, 1], [1, 1, 0]])
    scores = t([[0, 0, 1], [0, 1, 0]])
    ref = torch.zeros(2, 3)
    # k1 = lp - 0; 5.0 is on padding
    log_prob = t([[0.1, 0.2, 0.3], [0.4, -0.2, 5.0]])
    rewards, current_kl = apply_kl_penalty(scores, log_prob, ref, mask, kl_coef=0.5, kind="kl")
    # rewards = scores - 0.5 * kl on valid tokens:
    #   row 0: -0.05, -0.1, 1 - 0.15 = 0.85; row 1: -0.2, 1 + 0.1 = 1.1, padding 0 - 0 = 0
    torch.testing.assert_close(
        rewards, t([[-0.05, -0.1, 0.85], [-0.2, 1.1, 0.0]]), atol=ATOL, rtol=0
    )
    # per-sequence mean KL: (0.1 + 0.2 + 0.3) / 3 = 0.2, (0.4 - 0.2) / 2 = 0.1 -> batch mean 0.15
    assert current_kl == pytest.approx(0.15)
