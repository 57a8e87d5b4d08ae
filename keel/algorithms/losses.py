"""Policy, value and entropy losses, and the one function that reduces a [B, T] loss to a scalar.

Gradient accumulation: a mini-batch is often split into micro-batches whose losses are
back-propagated one by one. Dividing each by its own token (or sequence) count weights the
micro-batches wrongly whenever their counts differ. Every loss here therefore takes optional
`global_tokens` / `global_seqs`, the counts of the whole mini-batch: with them, the sum of the
micro-batch losses equals the mini-batch loss exactly. Across data-parallel ranks, pass the counts
summed over ranks and scale the loss by the world size, since the gradient all-reduce averages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .utils import masked_mean, masked_sum

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def agg_loss(
    loss_mat: Tensor,  # [B, T]
    loss_mask: Tensor,  # [B, T]
    mode: str,
    *,
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_length: int | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar; `mode` is verl's `loss_agg_mode`.

    `norm_length` is the constant of `seq-mean-token-sum-norm`, normally max_response_length: the
    padded length of one rollout changes from step to step, and so would the loss scale.

    Only sequences with at least one valid token count as sequences, so an all-padding row
    neither adds to nor dilutes a seq-mean. A micro-batch with no valid token at all gives 0.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {list(LOSS_AGG_MODES)}")
    if mode == "token-mean":
        n_tokens = loss_mask.sum().clamp(min=1) if global_tokens is None else global_tokens
        return masked_sum(loss_mat, loss_mask) / n_tokens
    if mode == "seq-mean-token-mean":
        seq_losses = masked_mean(loss_mat, loss_mask, dim=-1)  # [B]
    elif mode == "seq-mean-token-sum":
        seq_losses = masked_sum(loss_mat, loss_mask, dim=-1)  # [B]
    # seq-mean-token-sum-norm
    else:
        # Dr. GRPO (arXiv 2503.20783): a constant normaliser (the padded length T) instead of each
        # sequence's own length, so long answers are not down-weighted per token.
        # verl sums over sequences here; we take the mean, like the other seq-mean modes.
        # [B]
        seq_losses = masked_sum(loss_mat, loss_mask, dim=-1) / (norm_length or loss_mask.shape[-1])
    n_seqs = (loss_mask.sum(dim=-1) > 0).sum().clamp(min=1) if global_seqs is None else global_seqs
    return seq_losses.sum() / n_seqs


@dataclass(frozen=True)
class PolicyLossParams:
    # ratio floor 1 - low
    clip_ratio_low: float = 0.2
    # ratio ceiling 1 + high; > low is DAPO's clip-higher (arXiv 2503.14476)
    clip_ratio_high: float = 0.2
    # dual-clip bound on -A * ratio for A < 0 (arXiv 1912.09729)
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    # seq-mean-token-sum-norm's constant: max_response_length
    norm_length: int | None = None

    def __post_init__(self) -> None:
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {self.clip_ratio_c}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(
                f"unknown loss_agg_mode {self.loss_agg_mode!r}; valid: {list(LOSS_AGG_MODES)}"
            )


@dataclass(frozen=True)
class PolicyLossInputs:
    old_log_prob: Tensor  # [B, T] at rollout time
    log_prob: Tensor  # [B, T] current policy
    advantages: Tensor  # [B, T]
    response_mask: Tensor  # [B, T]
    # the whole mini-batch's counts (see the top)
    global_tokens: float | Tensor | None = None
    global_seqs: float | Tensor | None = None
    is_weights: Tensor | None = None  # [B, T] rollout correction's, detached

    def aggregate(self, losses: Tensor, p: PolicyLossParams, mode: str | None = None) -> Tensor:
        """The per-token losses [B, T], re-weighted by the rollout correction's IS weights when
        there are any, reduced by `mode` (default: the configured loss_agg_mode)."""
        if self.is_weights is not None:
            losses = losses * self.is_weights
        return agg_loss(
            losses,
            self.response_mask,
            mode or p.loss_agg_mode,
            global_tokens=self.global_tokens,
            global_seqs=self.global_seqs,
            norm_length=p.norm_length,
        )


PolicyLossFn = Callable[[PolicyLossInputs, PolicyLossParams], tuple[Tensor, dict[str, Tensor]]]


POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return decorator


def compute_policy_loss(
    name: str,
    old_log_prob: Tensor,  # [B, T]
    log_prob: Tensor,  # [B, T]
    advantages: Tensor,  # [B, T]
    response_mask: Tensor,  # [B, T]
    p: PolicyLossParams,
    *,
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    is_weights: Tensor | None = None,  # [B, T] truncated IS weights (algorithm.rollout_correction)
) -> tuple[Tensor, dict[str, Tensor]]:
    """Returns (scalar loss, metrics {pg_clipfrac, ppo_kl, pg_clipfrac_lower}, detached)."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name](
        PolicyLossInputs(
            old_log_prob,
            log_prob,
            advantages,
            response_mask,
            global_tokens,
            global_seqs,
            is_weights,
        ),
        p,
    )


def _metrics(clipped: Tensor, dual_clipped: Tensor, x: PolicyLossInputs) -> dict[str, Tensor]:
    """Fractions over valid tokens (local to this micro-batch: they are logged, not optimised)."""
    mask = x.response_mask
    return {
        "pg_clipfrac": masked_mean(clipped.float(), mask).detach(),
        "ppo_kl": masked_mean(x.old_log_prob - x.log_prob, mask).detach(),
        "pg_clipfrac_lower": masked_mean(dual_clipped.float(), mask).detach(),
    }


@register_policy_loss("vanilla")
def vanilla(x: PolicyLossInputs, p: PolicyLossParams) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate (arXiv 1707.06347) with clip-higher and dual-clip."""
    advantages = x.advantages
    # exp(20) is finite in bf16/fp32; an unclamped log-ratio from a stale or garbage position
    # would overflow to inf and turn the loss into nan even when masked.
    ratio = torch.exp(torch.clamp(x.log_prob - x.old_log_prob, -20.0, 20.0))  # [B, T]
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - p.clip_ratio_low, 1 + p.clip_ratio_high)
    # pessimistic bound
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    # Dual-clip: for A < 0 the PPO bound grows without limit in the ratio; cap it at -A * c.
    loss_cap = -advantages * p.clip_ratio_c
    negative = advantages < 0
    losses = torch.where(negative, torch.minimum(loss_ppo, loss_cap), loss_ppo)  # [B, T]
    loss = x.aggregate(losses, p)
    return loss, _metrics(loss_clipped > loss_unclipped, negative & (loss_ppo > loss_cap), x)


@register_policy_loss("gspo")
def gspo(x: PolicyLossInputs, p: PolicyLossParams) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (arXiv 2507.18071): one length-normalised importance ratio per sequence.

    The ratio's value is the sequence's geometric-mean token ratio; the `log_prob -
    log_prob.detach()` term is 0 in value but routes its gradient to every token. Reduced by
    `p.loss_agg_mode`, as verl 0.9.1's compute_policy_loss_gspo does: the paper's objective is
    seq-mean-token-mean (verl's GSPO examples set it), verl's and keel's default token-mean.
    """
    seq_log_ratio = masked_mean(x.log_prob - x.old_log_prob, x.response_mask, dim=-1)  # [B]
    log_ratio = x.log_prob - x.log_prob.detach() + seq_log_ratio.detach()[:, None]  # [B, T]
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    loss_unclipped = -x.advantages * ratio
    loss_clipped = -x.advantages * torch.clamp(ratio, 1 - p.clip_ratio_low, 1 + p.clip_ratio_high)
    losses = torch.maximum(loss_unclipped, loss_clipped)  # [B, T]
    loss = x.aggregate(losses, p)
    no_dual_clip = torch.zeros_like(x.response_mask, dtype=torch.bool)
    return loss, _metrics(loss_clipped > loss_unclipped, no_dual_clip, x)


@register_policy_loss("gpg")
def gpg(x: PolicyLossInputs, p: PolicyLossParams) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG (arXiv 2504.02546): the plain policy gradient -A log pi, no ratio and no clipping."""
    losses = -x.advantages * x.log_prob
    loss = x.aggregate(losses, p)
    no_clip = torch.zeros_like(x.response_mask, dtype=torch.bool)
    return loss, _metrics(no_clip, no_clip, x)


@register_policy_loss("cispo")
def cispo(x: PolicyLossInputs, p: PolicyLossParams) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (arXiv 2506.13585): the importance ratio is clipped and detached, and weights
    -A log pi, so every token keeps a gradient (PPO's clip zeroes it)."""
    ratio = torch.exp(torch.clamp(x.log_prob - x.old_log_prob, -20.0, 20.0))
    clipped = torch.clamp(ratio, 1 - p.clip_ratio_low, 1 + p.clip_ratio_high)
    losses = -clipped.detach() * x.advantages * x.log_prob
    loss = x.aggregate(losses, p)
    return loss, _metrics(ratio != clipped, torch.zeros_like(x.response_mask, dtype=torch.bool), x)


def compute_value_loss(
    vpreds: Tensor,  # [B, T] current critic
    returns: Tensor,  # [B, T] targets
    values: Tensor,  # [B, T] critic at rollout time
    response_mask: Tensor,  # [B, T]
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    *,
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss, as verl: returns (vf_loss, vf_clipfrac)."""
    vpred_clipped = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpred_clipped - returns) ** 2
    losses = torch.maximum(loss_unclipped, loss_clipped)  # [B, T]
    vf_loss = 0.5 * agg_loss(
        losses,
        response_mask,
        loss_agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_length=norm_length,
    )
    vf_clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask).detach()
    return vf_loss, vf_clipfrac
