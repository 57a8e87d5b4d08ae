"""Loss aggregation, policy losses, value loss and entropy against numbers worked out by hand."""

import math

import pytest
import torch

from keel.algorithms.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    PolicyLossParams,
    agg_loss,
    compute_policy_loss,
    compute_value_loss,
)
from keel.algorithms.utils import entropy_from_logits

ATOL = 1e-5


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def approx(x):
    return pytest.approx(x, abs=ATOL)


# --- aggregation -----------------------------------------------------------------------------
# B=3, T=3; row 2 is all padding and must count as no sequence at all.
LOSS = t([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
LOSS_MASK = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        # (1 + 2 + 3 + 4) / 4 tokens
        ("token-mean", 2.5),
        # (6 + 4) / 2 seqs
        ("seq-mean-token-sum", 5.0),
        # (6/3 + 4/1) / 2 seqs = (2 + 4) / 2
        ("seq-mean-token-mean", 3.0),
        # (6/3 + 4/3) / 2 seqs, T = 3 for every row
        ("seq-mean-token-sum-norm", 10 / 6),
    ],
)
def test_agg_loss_modes(mode, expected):
    assert agg_loss(LOSS, LOSS_MASK, mode).item() == approx(expected)


# B=4, T=3, split into micro-batches rows {0, 1} and {2, 3}, holding 4 and 2 tokens.
# per row: sums 6, 4, 15, (padding); means 2, 4, 7.5; 6 tokens and 3 sequences in all.
MB_LOSS = t([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]])
MB_MASK = t([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        # (6 + 4 + 15) / 6 tokens = 4.16667
        ("token-mean", 25 / 6),
        # (6 + 4 + 15) / 3 seqs = 8.33333
        ("seq-mean-token-sum", 25 / 3),
        # (2 + 4 + 7.5) / 3 seqs
        ("seq-mean-token-mean", 4.5),
        # (6/3 + 4/3 + 15/3) / 3 seqs = 2.77778
        ("seq-mean-token-sum-norm", 25 / 9),
    ],
)
def test_micro_batches_with_global_counts_sum_to_full_batch(mode, expected):
    assert agg_loss(MB_LOSS, MB_MASK, mode).item() == approx(expected)
    micro = [
        agg_loss(MB_LOSS[rows], MB_MASK[rows], mode, global_tokens=6, global_seqs=3)
        for rows in (slice(0, 2), slice(2, 4))
    ]
    assert sum(micro).item() == approx(expected)


def test_micro_batches_without_global_counts_are_weighted_wrongly():
    # token-mean per micro-batch: 10 / 4 = 2.5 and 15 / 2 = 7.5; their mean 5.0 != 25 / 6
    local = [agg_loss(MB_LOSS[r], MB_MASK[r], "token-mean") for r in (slice(0, 2), slice(2, 4))]
    assert [x.item() for x in local] == [approx(2.5), approx(7.5)]
    full = agg_loss(MB_LOSS, MB_MASK, "token-mean").item()
    assert full == approx(25 / 6) and sum(x.item() for x in local) / 2 != approx(full)


def test_agg_loss_all_padding_is_zero_not_nan():
    for mode in LOSS_AGG_MODES:
        assert agg_loss(LOSS[2:], LOSS_MASK[2:], mode).item() == 0.0


def test_unknown_agg_mode_lists_valid_modes():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'token_mean'") as err:
        agg_loss(LOSS, LOSS_MASK, "token_mean")
    assert all(mode in str(err.value) for mode in LOSS_AGG_MODES)


# --- PPO policy loss ----------------------------------------------------------------------------
# old_log_prob = 0 and log_prob = ln(ratio), so every token's ratio is chosen by hand.
# Padded positions get a garbage log-prob of 100: the log-ratio clamp keeps it finite.


def ppo_batch(ratios, advantages, mask):
    log_prob = torch.log(t(ratios)).masked_fill(t(mask) == 0, 100.0).requires_grad_()
    return torch.zeros_like(log_prob), log_prob, t(advantages), t(mask)


def test_vanilla_symmetric_with_dual_clip():
    old, lp, adv, mask = ppo_batch(
        ratios=[[1.5, 0.5, 1.1, 1.0], [1.5, 0.5, 5.0, 1.0]],
        advantages=[[1, 1, 1, 0], [-1, -1, -1, 0]],
        mask=[[1, 1, 1, 0], [1, 1, 1, 0]],
    )
    loss, m = compute_policy_loss("vanilla", old, lp, adv, mask, PolicyLossParams())
    # clip to [0.8, 1.2]; per token max(-A r, -A clip(r)), then for A < 0 min(., -A * 3):
    # A=+1: r=1.5: max(-1.5, -1.2) = -1.2 (clipped); r=0.5: max(-0.5, -0.8) = -0.5; r=1.1: -1.1
    # A=-1: r=1.5: max(1.5, 1.2) = 1.5; r=0.5: max(0.5, 0.8) = 0.8 (clipped);
    #       r=5.0: max(5.0, 1.2) = 5.0 -> dual clip min(5.0, 3.0) = 3.0
    # token-mean: (-1.2 - 0.5 - 1.1 + 1.5 + 0.8 + 3.0) / 6 = 2.5 / 6 = 0.41667
    assert loss.item() == approx(2.5 / 6)
    # (r=1.5, A=+1) and (r=0.5, A=-1)
    assert m["pg_clipfrac"].item() == approx(2 / 6)
    # (r=5.0, A=-1)
    assert m["pg_clipfrac_lower"].item() == approx(1 / 6)
    # ppo_kl = mean(old - lp) = -(2 ln1.5 + 2 ln0.5 + ln1.1 + ln5) / 6
    #        = -(0.81093 - 1.38629 + 0.09531 + 1.60944) / 6 = -1.12938 / 6 = -0.18823
    assert m["ppo_kl"].item() == approx(-0.18823)
    loss.backward()
    # d(-A r)/d lp = -A r on unclipped tokens, / 6 tokens; clipped and dual-clipped tokens get 0
    # A=+1: r=0.5 -> -0.5/6 = -0.08333; r=1.1 -> -1.1/6 = -0.18333
    # A=-1: r=1.5 -> 1.5/6 = 0.25
    torch.testing.assert_close(
        lp.grad, t([[0, -0.08333, -0.18333, 0], [0.25, 0, 0, 0]]), atol=ATOL, rtol=0
    )


def test_vanilla_clip_higher_is_asymmetric():
    old, lp, adv, mask = ppo_batch(
        ratios=[[1.5, 1.25, 0.5], [0.75, 1.0, 1.0]],
        advantages=[[1, 1, 1], [-1, 0, 0]],
        mask=[[1, 1, 1], [1, 0, 0]],
    )
    p = PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss, m = compute_policy_loss("vanilla", old, lp, adv, mask, p)
    # clip to [0.8, 1.28]:
    # A=+1: r=1.5 -> max(-1.5, -1.28) = -1.28 (clipped); r=1.25 -> -1.25 (a symmetric 0.2 would
    #       give -1.2); r=0.5 -> max(-0.5, -0.8) = -0.5
    # A=-1: r=0.75 -> max(0.75, 0.8) = 0.8 (clipped at the low side)
    # token-mean: (-1.28 - 1.25 - 0.5 + 0.8) / 4 = -2.23 / 4 = -0.5575
    assert loss.item() == approx(-0.5575)
    assert m["pg_clipfrac"].item() == approx(2 / 4)
    assert m["pg_clipfrac_lower"].item() == 0.0


def test_dual_clip_only_applies_to_negative_advantages():
    old, lp, adv, mask = ppo_batch(
        ratios=[[5.0, 5.0, 2.0]],
        advantages=[[1, -1, -1]],
        mask=[[1, 1, 1]],
    )
    loss, m = compute_policy_loss("vanilla", old, lp, adv, mask, PolicyLossParams(clip_ratio_c=3.0))
    # A=+1, r=5: max(-5, -1.2) = -1.2 (a dual clip here would wrongly give min(-1.2, -3) = -3)
    # A=-1, r=5: max(5, 1.2) = 5 -> min(5, 3) = 3 (dual clip)
    # A=-1, r=2: max(2, 1.2) = 2 -> min(2, 3) = 2 (under the cap)
    # token-mean: (-1.2 + 3 + 2) / 3 = 3.8 / 3 = 1.26667
    assert loss.item() == approx(3.8 / 3)
    assert m["pg_clipfrac_lower"].item() == approx(1 / 3)
    # only A=+1, r=5: -1.2 > -5
    assert m["pg_clipfrac"].item() == approx(1 / 3)


def test_vanilla_passes_agg_mode_and_global_counts():
    old, lp, adv, mask = ppo_batch(
        ratios=[[1.0, 1.0], [1.0, 1.0]], advantages=[[2, 4], [1, 0]], mask=[[1, 1], [1, 0]]
    )
    # r = 1 everywhere -> losses -A: [-2, -4], [-1, pad]
    # seq-mean-token-mean: (-3 + -1) / 2 = -2.0; with global_seqs=4: (-3 - 1) / 4 = -1.0
    p = PolicyLossParams(loss_agg_mode="seq-mean-token-mean")
    assert compute_policy_loss("vanilla", old, lp, adv, mask, p)[0].item() == approx(-2.0)
    assert compute_policy_loss("vanilla", old, lp, adv, mask, p, global_seqs=4)[0].item() == approx(
        -1.0
    )
    # token-mean with global_tokens=7: (-2 - 4 - 1) / 7 = -1.0
    p = PolicyLossParams()
    assert compute_policy_loss("vanilla", old, lp, adv, mask, p, global_tokens=7)[
        0
    ].item() == approx(-1.0)


def test_gspo_sequence_level_ratio():
    mask = t([[1, 1, 0], [1, 1, 1]])
    log_prob = t([[0.2, 0.4, 100.0], [-0.1, 0.0, -0.2]]).requires_grad_()
    old = torch.zeros_like(log_prob)
    adv = t([[1, 1, 0], [-1, -1, -1]])
    # the paper's objective
    p = PolicyLossParams(loss_agg_mode="seq-mean-token-mean")
    loss, m = compute_policy_loss("gspo", old, log_prob, adv, mask, p)
    # row 0: seq ratio exp((0.2 + 0.4) / 2) = exp(0.3) = 1.34986 > 1.2 -> clipped, A=+1: -1.2 per
    # token row 1: seq ratio exp((-0.1 + 0 - 0.2) / 3) = exp(-0.1) = 0.90484 in [0.8, 1.2], A=-1:
    # 0.90484 seq-mean-token-mean: (-1.2 + 0.90484) / 2 = -0.14758
    assert loss.item() == approx(-0.14758)
    # both valid tokens of row 0
    assert m["pg_clipfrac"].item() == approx(2 / 5)
    assert m["pg_clipfrac_lower"].item() == 0.0
    # -(0.2 + 0.4 - 0.1 + 0 - 0.2) / 5 = -0.3 / 5
    assert m["ppo_kl"].item() == approx(-0.06)
    loss.backward()
    # row 1, each token: d(-A * ratio)/d lp_t = ratio = 0.90484 (the detached seq ratio times
    # exp(lp - sg(lp)) = 1), / 3 tokens / 2 seqs = 0.15081; row 0 is clipped -> 0
    torch.testing.assert_close(log_prob.grad, t([[0, 0, 0], [0.15081] * 3]), atol=ATOL, rtol=0)


def test_gspo_honours_loss_agg_mode_as_verl_0_9_1_does():
    mask = t([[1, 1, 0], [1, 1, 1]])
    log_prob = t([[0.2, 0.4, 100.0], [-0.1, 0.0, -0.2]])
    adv = t([[1, 1, 0], [-1, -1, -1]])
    token_mean = compute_policy_loss(
        "gspo", torch.zeros_like(log_prob), log_prob, adv, mask, PolicyLossParams()
    )[0]
    # token-mean (the default): (2 * -1.2 + 3 * 0.90484) / 5 tokens = 0.06290
    assert token_mean.item() == approx(0.06290)


def _verl_functions(module: str, names: tuple[str, ...], namespace: dict) -> dict:
    """verl's own functions `names`, from the installed verl's source file of `module`, executed in
    `namespace` (their module imports Ray-era packages the test does not need)."""
    import ast
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from verl_shim import verl_root

    root = verl_root()
    if root is None:
        pytest.skip("verl is not installed (make test installs it)")
    source = (root / (module.replace(".", "/") + ".py")).read_text()
    tree = ast.parse(source)
    chosen = [
        node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names
    ]
    for node in chosen:
        node.decorator_list = []
    exec(compile(ast.Module(body=chosen, type_ignores=[]), module, "exec"), namespace)
    return {name: namespace[name] for name in names}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gspo_gives_verls_loss_and_gradient_in_every_loss_agg_mode(mode):
    """verl 0.9.1's compute_policy_loss_gspo and agg_loss, run beside keel's on the same inputs."""
    from types import SimpleNamespace
    from typing import Any, Optional

    torch_functional = _verl_functions(
        "utils.torch_functional", ("masked_sum", "masked_mean"), {"torch": torch}
    )

    class ActorConfig(SimpleNamespace):
        pass

    verl = _verl_functions(
        "trainer.ppo.core_algos",
        ("agg_loss", "compute_policy_loss_gspo"),
        {
            "torch": torch,
            "Optional": Optional,
            "Any": Any,
            "ActorConfig": ActorConfig,
            "verl_F": SimpleNamespace(**torch_functional),
        },
    )
    generator = torch.Generator().manual_seed(7)
    mask = (torch.rand(4, 6, generator=generator) > 0.3).float()
    mask[:, 0] = 1.0
    old = -torch.rand(4, 6, generator=generator)
    advantages = torch.randn(4, 1, generator=generator).expand(4, 6).contiguous()
    base = old + 0.3 * torch.randn(4, 6, generator=generator)
    keel_lp, verl_lp = base.clone().requires_grad_(), base.clone().requires_grad_()
    config = ActorConfig(
        clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, global_batch_info={}
    )
    verl_loss, verl_metrics = verl["compute_policy_loss_gspo"](
        old, verl_lp, advantages, mask, loss_agg_mode=mode, config=config
    )
    p = PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode)
    keel_loss, keel_metrics = compute_policy_loss("gspo", old, keel_lp, advantages, mask, p)
    (verl_loss + 0).backward()
    keel_loss.backward()
    assert keel_loss.item() == approx(verl_loss.item())
    torch.testing.assert_close(keel_lp.grad, verl_lp.grad, atol=ATOL, rtol=0)
    assert keel_metrics["pg_clipfrac"].item() == approx(verl_metrics["actor/pg_clipfrac"])


def test_policy_loss_registry_and_unknown_name():
    assert {"vanilla", "gspo"} <= set(POLICY_LOSSES)
    old, lp, adv, mask = ppo_batch(ratios=[[1.0]], advantages=[[1]], mask=[[1]])
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'") as err:
        compute_policy_loss("ppo", old, lp, adv, mask, PolicyLossParams())
    assert "'vanilla'" in str(err.value) and "'gspo'" in str(err.value)


def test_policy_loss_params_validate():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLossParams(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        PolicyLossParams(loss_agg_mode="sum")


# --- value loss and entropy ---------------------------------------------------------------------


def test_value_loss_clipping():
    # tokens: a = (values 1, vpred 2, return 3), b = (1, 1.2, 0) | c = (0, -1, 0), padding
    values = t([[1.0, 1.0], [0.0, 0.0]])
    vpreds = t([[2.0, 1.2], [-1.0, 50.0]])
    returns = t([[3.0, 0.0], [0.0, 0.0]])
    mask = t([[1, 1], [1, 0]])
    # clip range 0.5: vpred_clipped = values + clamp(vpreds - values, -0.5, 0.5)
    # a: clipped 1.5; (2 - 3)^2 = 1 vs (1.5 - 3)^2 = 2.25 -> 2.25 (clip active)
    # b: clipped 1.2 (inside); 1.44 vs 1.44 -> 1.44
    # c: clipped -0.5; (-1)^2 = 1 vs (-0.5)^2 = 0.25 -> 1 (clipped is smaller: not active)
    vf_loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, 0.5, "token-mean")
    # 0.5 * 4.69 / 3 = 0.78167
    assert vf_loss.item() == approx(0.5 * (2.25 + 1.44 + 1.0) / 3)
    assert clipfrac.item() == approx(1 / 3)
    # seq-mean-token-sum: 0.5 * ((2.25 + 1.44) + 1.0) / 2 = 0.5 * 4.69 / 2 = 1.1725
    vf_loss, _ = compute_value_loss(vpreds, returns, values, mask, 0.5, "seq-mean-token-sum")
    assert vf_loss.item() == approx(1.1725)
    # global_tokens=6 instead of the local 3: 0.5 * 4.69 / 6 = 0.39083
    vf_loss, _ = compute_value_loss(
        vpreds, returns, values, mask, 0.5, "token-mean", global_tokens=6
    )
    assert vf_loss.item() == approx(0.39083)


def test_entropy_from_logits():
    logits = torch.stack([t([0.0, 0.0]), t([0.0, math.log(3.0)])])  # [2, V=2]
    # uniform over 2: ln 2 = 0.69315
    # probs [1/4, 3/4]: logsumexp = ln 4 = 1.38629; sum p z = 0.75 ln 3 = 0.82396 -> 0.56233
    torch.testing.assert_close(
        entropy_from_logits(logits), t([0.69315, 0.56233]), atol=ATOL, rtol=0
    )


def test_token_sum_norm_divides_by_the_constant_length_not_the_padded_width():
    loss = t([[1.0, 2.0, 3.0]])
    mask = t([[1, 1, 1]])
    # Dr. GRPO's constant is max_response_length (say 8), whatever the rollout's padded width (3):
    # (1 + 2 + 3) / 8 = 0.75 for the one sequence
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", norm_length=8).item() == approx(0.75)
    # 6 / 3 without it
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == approx(2.0)
