"""Advantage estimators: token-level rewards (plus values, groups or baselines) -> advantages.

Every estimator has one signature, `fn(inp, p) -> (advantages [B, T], returns [B, T])`, both zero
where the mask is, and lives in `ADV_ESTIMATORS` under verl's name (`algorithm.adv_estimator`).
A masked span inside a response (a tool's output or a user turn between assistant turns) is not
the model's action: every estimator treats it as absent, so the turns before it get the credit
they would get with the span cut out. The
registry entry says which optional inputs it needs, so the trainer knows whether to run a
critic (`needs_critic`) or a greedy baseline rollout (`needs_baseline`) before calling it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from .utils import masked_whiten


@dataclass
class AdvantageInputs:
    token_level_rewards: Tensor  # [B, T] (outcome reward usually sits on the last valid token)
    response_mask: Tensor  # [B, T] 1 for response tokens, 0 for padding
    group_index: Tensor | None = None  # [B] int: samples of the same prompt share a value
    values: Tensor | None = None  # [B, T] critic values (gae)
    baseline_rewards: Tensor | None = None  # [B] reward of the greedy rollout (remax)


@dataclass
class AdvantageParams:
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    epsilon: float = 1e-6


EstimatorFn = Callable[[AdvantageInputs, AdvantageParams], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    fn: EstimatorFn
    # reads inp.values
    needs_critic: bool
    # reads inp.baseline_rewards
    needs_baseline: bool
    # reads inp.group_index
    needs_group: bool

    def check_inputs(self, inp: AdvantageInputs) -> None:
        required = {
            "values": self.needs_critic,
            "baseline_rewards": self.needs_baseline,
            "group_index": self.needs_group,
        }
        for field_name, needed in required.items():
            if needed and getattr(inp, field_name) is None:
                raise ValueError(
                    f"advantage estimator {self.name!r} needs `{field_name}`, got None"
                )
        if inp.token_level_rewards.shape != inp.response_mask.shape:
            raise ValueError(
                f"token_level_rewards {tuple(inp.token_level_rewards.shape)} and response_mask "
                f"{tuple(inp.response_mask.shape)} must have the same [B, T] shape"
            )

    def __call__(self, inp: AdvantageInputs, p: AdvantageParams) -> tuple[Tensor, Tensor]:
        self.check_inputs(inp)
        # Advantages and returns are regression/weighting targets: never differentiate through them.
        with torch.no_grad():
            return self.fn(inp, p)


ADV_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_adv_est(
    name: str, needs_critic: bool = False, needs_baseline: bool = False, needs_group: bool = False
) -> Callable[[EstimatorFn], EstimatorFn]:
    def decorator(fn: EstimatorFn) -> EstimatorFn:
        if name in ADV_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADV_ESTIMATORS[name] = AdvantageEstimator(
            name, fn, needs_critic, needs_baseline, needs_group
        )
        return fn

    return decorator


def compute_advantage(
    name: str, inp: AdvantageInputs, p: AdvantageParams, final_rows: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """`final_rows` ([B] the row of each row's sample's final segment; None: each row is a sample):
    a sample trained as several rows (segments) counts once in its group's statistics; a group
    estimator's advantage is a row's scalar, so its other segments take its final segment's. Other
    estimators see every segment as a trajectory of its own, ending in the sample's reward."""
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {sorted(ADV_ESTIMATORS)}")
    estimator = ADV_ESTIMATORS[name]
    if final_rows is None or not estimator.needs_group:
        return estimator(inp, p)
    # sorted
    finals = final_rows.unique()
    advantages, returns = estimator(_rows_of(inp, finals), p)
    last = (
        (inp.response_mask[finals].bool() * torch.arange(inp.response_mask.shape[1])).max(-1).values
    )
    # each row's sample among `finals`
    of = torch.searchsorted(finals, final_rows)
    mask = inp.response_mask.to(advantages.dtype)
    at_last = torch.arange(len(finals))
    return advantages[at_last, last][of, None] * mask, returns[at_last, last][of, None] * mask


def _rows_of(inp: AdvantageInputs, rows: Tensor) -> AdvantageInputs:
    values = (getattr(inp, f.name) for f in fields(inp))
    return AdvantageInputs(*(None if value is None else value[rows] for value in values))


def _group_mean_std(scores: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample mean, unbiased std and size of its group: [B] -> 3 x [B].

    A group of one has no spread to compare against: verl gives it mean 0 and std 1, so its
    advantage is its raw score; we keep that.
    """
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    n = counts.to(scores.dtype)  # [G]
    mean = torch.zeros_like(n).index_add_(0, inverse, scores) / n  # [G]
    sq_dev = torch.zeros_like(n).index_add_(0, inverse, (scores - mean[inverse]) ** 2)  # [G]
    std = (sq_dev / (n - 1).clamp(min=1)).sqrt()  # [G], Bessel-corrected as torch.std
    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[inverse], std[inverse], n[inverse]


@register_adv_est("gae", needs_critic=True)
def gae(inp: AdvantageInputs, p: AdvantageParams) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (arXiv 1506.02438), as verl's compute_gae_advantage_return.

    Masked positions inside a response (e.g. tool observations in multi-turn rollouts) are
    skipped: the next value and the running GAE are carried across them unchanged.
    """
    rewards, values, mask = (
        inp.token_level_rewards,
        inp.values,
        inp.response_mask.to(inp.values.dtype),
    )
    next_value = torch.zeros_like(values[:, 0])  # [B]
    last_gae = torch.zeros_like(values[:, 0])  # [B]
    advantages = torch.zeros_like(values)  # [B, T]
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + p.gamma * next_value - values[:, t]
        gae_t = delta + p.gamma * p.lam * last_gae
        next_value = torch.where(mask[:, t] > 0, values[:, t], next_value)
        last_gae = torch.where(mask[:, t] > 0, gae_t, last_gae)
        advantages[:, t] = last_gae
    # critic target, on the reward's own scale
    returns = (advantages + values) * mask
    return masked_whiten(advantages, mask) * mask, returns


@register_adv_est("grpo", needs_group=True)
def grpo(inp: AdvantageInputs, p: AdvantageParams) -> tuple[Tensor, Tensor]:
    """GRPO (arXiv 2402.03300): outcome score normalised within the prompt's group.

    With `norm_adv_by_std_in_grpo=False` the std division is dropped, as Dr. GRPO
    (arXiv 2503.20783) argues it up-weights prompts that are nearly always right or wrong.
    """
    scores = inp.token_level_rewards.sum(dim=-1)  # [B]
    mean, std, _ = _group_mean_std(scores, inp.group_index)
    adv = scores - mean
    if p.norm_adv_by_std_in_grpo:
        adv = adv / (std + p.epsilon)
    adv = adv[:, None] * inp.response_mask  # [B, T]
    return adv, adv


@register_adv_est("rloo", needs_group=True)
def rloo(inp: AdvantageInputs, p: AdvantageParams) -> tuple[Tensor, Tensor]:
    """RLOO (arXiv 2402.14740): the baseline is the mean score of the group's other samples."""
    scores = inp.token_level_rewards.sum(dim=-1)  # [B]
    mean, _, n = _group_mean_std(scores, inp.group_index)
    # mean of the others = (n * mean - score) / (n - 1); a group of one has no others, baseline 0.
    baseline = torch.where(
        n > 1, (n * mean - scores) / (n - 1).clamp(min=1), torch.zeros_like(scores)
    )
    adv = (scores - baseline)[:, None] * inp.response_mask  # [B, T]
    return adv, adv


@register_adv_est("reinforce_plus_plus")
def reinforce_plus_plus(inp: AdvantageInputs, p: AdvantageParams) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (arXiv 2501.03262): discounted return-to-go, whitened over the batch.

    The return is carried across masked positions unchanged and undiscounted (as GAE's is): a
    tool's output inside a response neither stops nor shrinks the credit of the turn before it, and
    padding after the end, where the sum starts at 0, adds nothing."""
    rewards, mask = inp.token_level_rewards, inp.response_mask.to(inp.token_level_rewards.dtype)
    returns = torch.zeros_like(rewards)  # [B, T]
    running = torch.zeros_like(rewards[:, 0])  # [B]
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t] > 0, rewards[:, t] + p.gamma * running, running)
        returns[:, t] = running
    return masked_whiten(returns, mask) * mask, returns * mask


@register_adv_est("reinforce_plus_plus_baseline", needs_group=True)
def reinforce_plus_plus_baseline(inp: AdvantageInputs, p: AdvantageParams) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with the group mean as baseline (arXiv 2501.03262), then batch whitening.

    Whitening over the whole batch rather than per group keeps the scale of groups relative to
    each other, which per-group std normalisation (GRPO) removes.
    """
    scores = inp.token_level_rewards.sum(dim=-1)  # [B]
    mean, _, _ = _group_mean_std(scores, inp.group_index)
    mask = inp.response_mask.to(scores.dtype)
    adv = (scores - mean)[:, None] * mask  # [B, T]
    adv = masked_whiten(adv, mask) * mask
    return adv, adv


@register_adv_est("remax", needs_baseline=True)
def remax(inp: AdvantageInputs, p: AdvantageParams) -> tuple[Tensor, Tensor]:
    """ReMax (arXiv 2310.10505): the greedy rollout's reward is the baseline."""
    mask = inp.response_mask.to(inp.token_level_rewards.dtype)
    # [B, T] reward-to-go
    returns = (inp.token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask
    adv = returns - inp.baseline_rewards[:, None] * mask
    return adv, returns


@register_adv_est("opo", needs_group=True)
def opo(inp: AdvantageInputs, p: AdvantageParams) -> tuple[Tensor, Tensor]:
    """OPO (arXiv 2505.23585), as verl: the baseline is the group's length-weighted mean score, the
    optimal baseline for a sequence-level policy gradient; a group of one has baseline 0."""
    scores = inp.token_level_rewards.sum(dim=-1)  # [B]
    lengths = inp.response_mask.sum(dim=-1).to(scores.dtype)  # [B]
    _, inverse, counts = torch.unique(inp.group_index, return_inverse=True, return_counts=True)
    weighted = torch.zeros(len(counts), dtype=scores.dtype).index_add_(0, inverse, lengths * scores)
    total = torch.zeros(len(counts), dtype=scores.dtype).index_add_(0, inverse, lengths)
    baseline = torch.where(counts > 1, weighted / total.clamp(min=1), torch.zeros_like(total))[
        inverse
    ]
    adv = (scores - baseline)[:, None] * inp.response_mask
    return adv, adv


@register_adv_est("gpg", needs_group=True)
def gpg(inp: AdvantageInputs, p: AdvantageParams) -> tuple[Tensor, Tensor]:
    """GPG (arXiv 2504.02546), as verl: the group mean as baseline, scaled by batch size over the
    number of non-zero scores (so a batch of mostly-zero rewards is not drowned out)."""
    scores = inp.token_level_rewards.sum(dim=-1)  # [B]
    mean, _, _ = _group_mean_std(scores, inp.group_index)
    alpha = len(scores) / torch.count_nonzero(scores).clamp(min=1)
    adv = (alpha * (scores - mean))[:, None] * inp.response_mask
    return adv, adv


@register_adv_est("grpo_passk", needs_group=True)
def grpo_passk(inp: AdvantageInputs, p: AdvantageParams) -> tuple[Tensor, Tensor]:
    """Pass@k training (arXiv 2503.19595), as verl: only each group's best sample gets an advantage,
    its margin over the second best (divided by the group's std with norm_adv_by_std_in_grpo)."""
    scores = inp.token_level_rewards.sum(dim=-1)  # [B]
    advantages = torch.zeros_like(scores)
    for group in torch.unique(inp.group_index):
        rows = (inp.group_index == group).nonzero().squeeze(-1)
        if len(rows) < 2:
            raise ValueError(
                f"grpo_passk needs 2 or more samples per prompt; group {int(group)} has {len(rows)}"
            )
        top, where = torch.topk(scores[rows], 2)
        margin = top[0] - top[1]
        advantages[rows[where[0]]] = (
            margin / (scores[rows].std() + p.epsilon) if p.norm_adv_by_std_in_grpo else margin
        )
    adv = advantages[:, None] * inp.response_mask
    return adv, adv
