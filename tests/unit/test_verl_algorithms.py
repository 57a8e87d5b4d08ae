"""The estimators and policy losses verl users reach for, each checked against verl's formula on
numbers worked by hand; verl's others are refused by name."""

import math

import pytest
import torch

from keel.algorithms.advantages import AdvantageInputs, AdvantageParams, compute_advantage
from keel.algorithms.losses import PolicyLossParams, compute_policy_loss
from keel.config.load import load_config
from keel.errors import VERL_UNSUPPORTED, KeelError


def outcome(scores, groups, lengths=None):
    """Token-level rewards with each score on its response's last token."""
    lengths = lengths or [3] * len(scores)
    mask = torch.zeros(len(scores), max(lengths))
    rewards = torch.zeros_like(mask)
    for i, (score, length) in enumerate(zip(scores, lengths)):
        mask[i, :length] = 1
        rewards[i, length - 1] = score
    return AdvantageInputs(rewards, mask, torch.tensor(groups))


def per_sample(advantages, inputs):
    return (advantages * inputs.response_mask).sum(-1) / inputs.response_mask.sum(-1)


def test_opo_subtracts_the_length_weighted_group_mean():
    # group a: scores 1 and 0 with 2 and 6 tokens: baseline (2*1 + 6*0) / 8 = 0.25; b alone:
    # baseline 0
    inp = outcome([1.0, 0.0, 0.5], [0, 0, 1], lengths=[2, 6, 4])
    adv, _ = compute_advantage("opo", inp, AdvantageParams())
    assert per_sample(adv, inp).tolist() == pytest.approx([0.75, -0.25, 0.5])


def test_gpg_scales_by_batch_size_over_non_zero_scores():
    # one non-zero score in four: alpha 4; group means 0.5 and 0
    inp = outcome([1.0, 0.0, 0.0, 0.0], [0, 0, 1, 1])
    adv, _ = compute_advantage("gpg", inp, AdvantageParams())
    assert per_sample(adv, inp).tolist() == pytest.approx([2.0, -2.0, 0.0, 0.0])


def test_grpo_passk_rewards_only_the_best_by_its_margin():
    # scores 1, 0.5, 0: the best gets 1 - 0.5 = 0.5, over the std 0.5 -> 1
    inp = outcome([1.0, 0.5, 0.0], [0, 0, 0])
    adv, _ = compute_advantage("grpo_passk", inp, AdvantageParams())
    assert per_sample(adv, inp).tolist() == pytest.approx([1.0, 0.0, 0.0], abs=1e-5)
    plain, _ = compute_advantage("grpo_passk", inp, AdvantageParams(norm_adv_by_std_in_grpo=False))
    assert per_sample(plain, inp).tolist() == pytest.approx([0.5, 0.0, 0.0])


def test_gpg_loss_is_the_plain_policy_gradient():
    log_prob = torch.tensor([[math.log(0.5), math.log(0.25)]], requires_grad=True)
    loss, _ = compute_policy_loss(
        "gpg",
        torch.zeros(1, 2),
        log_prob,
        torch.tensor([[2.0, 2.0]]),
        torch.ones(1, 2),
        PolicyLossParams(),
    )
    assert loss.item() == pytest.approx(-(2 * math.log(0.5) + 2 * math.log(0.25)) / 2)
    loss.backward()
    # -A / tokens
    assert log_prob.grad.tolist() == [[-1.0, -1.0]]


def test_cispo_clips_and_detaches_the_ratio_and_keeps_every_tokens_gradient():
    # ratios 2 and 0.5 clip to 1.2 and 0.8; the loss is -sg(clip(r)) A log pi, A = 1
    old = torch.zeros(1, 2)
    log_prob = torch.tensor([[math.log(2.0), math.log(0.5)]], requires_grad=True)
    loss, metrics = compute_policy_loss(
        "cispo",
        old,
        log_prob,
        torch.ones(1, 2),
        torch.ones(1, 2),
        PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.2),
    )
    assert loss.item() == pytest.approx(-(1.2 * math.log(2.0) + 0.8 * math.log(0.5)) / 2)
    loss.backward()
    # both clipped, both still learn
    assert log_prob.grad[0].tolist() == pytest.approx([-0.6, -0.4])
    assert metrics["pg_clipfrac"].item() == 1.0


BASE = {
    "data.train_files": ["a.parquet"],
    "actor_rollout_ref.model.path": "m",
    "actor_rollout_ref.rollout.n": 2,
}


@pytest.mark.parametrize(
    "key, value",
    [
        ("actor_rollout_ref.actor.policy_loss.loss_mode", "clip_cov"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", "sapo"),
        ("algorithm.adv_estimator", "optimal_token_baseline"),
    ],
)
def test_verls_other_algorithms_are_refused_by_name(key, value):
    with pytest.raises(KeelError) as error:
        load_config({}, {**BASE, key: value})
    assert error.value.code == VERL_UNSUPPORTED and value in error.value.message


def test_verls_vectorised_estimators_are_keels_own():
    assert (
        load_config(
            {}, {**BASE, "algorithm.adv_estimator": "rloo_vectorized"}
        ).algorithm.adv_estimator
        == "rloo"
    )
