"""Rollout correction (verl's `algorithm.rollout_correction`): the sampler's policy is not quite
the trainer's (bf16 kernels, another engine, weights a step old), so the samples come from
pi_rollout while the loss is written for pi_old. Truncated importance-sampling weights (TIS,
fengyao.notion.site/off-policy-rl) re-weight each token or sequence by pi_train / pi_rollout;
rejection sampling (verl's `rollout_rs`: MIS and its divergence filters, richardli.xyz/rl-collapse)
drops the tokens or sequences whose ratio strays too far.

Everything here reads log_ratio = log pi_train - log pi_rollout, masked by the response mask, and
returns detached tensors: the weights change the measure, not the objective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from keel.algorithms.utils import masked_mean, masked_sum

# log-ratios are clamped to +-20 before exp: exp(20) is finite in fp32
SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
# verl's rejection statistics: k1 = -log_ratio (a ratio band), k2 = log_ratio^2 / 2,
# k3 = exp(log_ratio) - 1 - log_ratio, per token or summed / averaged / maxed over a sequence.
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


@dataclass(frozen=True)
class RejectionRule:
    # one of RS_OPTIONS
    option: str
    # k1: log of the ratio band's top; k2/k3: the statistic's ceiling
    upper: float
    # k1 only: log of the band's bottom
    lower: float | None = None


@dataclass(frozen=True)
class CorrectionParams:
    # "token" | "sequence" | None: no weights
    is_level: str | None = None
    # weights are truncated at this value
    is_threshold: float = 2.0
    # weights rescaled to mean 1 over the batch
    is_batch_normalize: bool = False
    rejection: tuple[RejectionRule, ...] = ()


@dataclass
class Correction:
    weights: Tensor | None  # [B, T] truncated IS weights, 0 on padding; None when is_level is None
    keep: Tensor  # [B, T] 1 where rejection sampling keeps the token
    # token means (0-d tensors), verl's names under rollout_corr/
    metrics: dict[str, Tensor]


def parse_rejection(rollout_rs: str | None, threshold: str | None) -> tuple[RejectionRule, ...]:
    """verl's `rollout_rs` ("token_k1,seq_mean_k3") and `rollout_rs_threshold` (one value for every
    option, or one per option, comma-separated; a k1 option takes "lower_upper" ratio bounds, or
    one upper bound u meaning [1/u, u]). Raises ValueError saying what is wrong."""
    if not rollout_rs:
        return ()
    options = list(dict.fromkeys(part.strip() for part in rollout_rs.split(",") if part.strip()))
    unknown = [o for o in options if o not in RS_OPTIONS]
    if unknown or not options:
        raise ValueError(
            f"rollout_rs={rollout_rs!r}: {unknown or 'no option'} not among {list(RS_OPTIONS)}"
        )
    if threshold is None:
        raise ValueError("rollout_rs is set but rollout_rs_threshold is not")
    specs = [part.strip() for part in str(threshold).split(",") if part.strip()]
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise ValueError(
            f"rollout_rs_threshold={threshold!r} gives {len(specs)} thresholds for "
            f"{len(options)} rollout_rs options: give one, or one per option"
        )
    return tuple(_rule(option, spec) for option, spec in zip(options, specs))


def _rule(option: str, spec: str) -> RejectionRule:
    k1 = option.endswith("k1")
    parts = spec.split("_") if k1 and "_" in spec else [spec]
    try:
        bounds = [float(p) for p in parts]
    except ValueError:
        raise ValueError(
            f"rollout_rs_threshold {spec!r} for {option} is not a number"
            + (" or 'lower_upper'" if k1 else "")
        ) from None
    if len(bounds) > 2 or not all(b > 0 and math.isfinite(b) for b in bounds):
        raise ValueError(
            f"rollout_rs_threshold {spec!r} for {option} must be positive"
            + ("" if k1 else ", one upper bound")
        )
    if not k1:
        return RejectionRule(option, bounds[0])
    lower, upper = bounds if len(bounds) == 2 else (1.0 / bounds[0], bounds[0])
    if lower > upper:
        raise ValueError(
            f"rollout_rs_threshold {spec!r} for {option}: the lower bound exceeds the upper"
        )
    return RejectionRule(option, math.log(upper), math.log(lower))


@torch.no_grad()
def compute_correction(
    train_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, p: CorrectionParams
) -> Correction:
    """IS weights, the rejection mask and mismatch metrics, from log-probs [B, T] of the sampled
    tokens under the trainer's policy and the sampler's."""
    mask = mask.to(train_log_probs.dtype)
    # where, not a product: padding may hold -inf or nan, and -inf * 0 is nan
    log_ratio = torch.where(mask.bool(), train_log_probs - rollout_log_probs, 0.0)
    keep = torch.ones_like(mask)
    for rule in p.rejection:
        keep = keep * _kept_by(rule, log_ratio, mask)
    metrics = mismatch_metrics(log_ratio, mask)
    metrics["rollout_corr/rollout_rs_masked_fraction"] = masked_mean(1.0 - keep, mask)
    weights = None
    if p.is_level is not None:
        weights, weight_metrics = _is_weights(log_ratio, mask, p)
        # a rejected token's weight may be nan
        weights = torch.where(keep.bool(), weights, 0.0)
        metrics.update(weight_metrics)
    return Correction(weights, keep, metrics)


def mismatch_metrics(log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far pi_rollout is from pi_train, per token: KL(rollout || train) by the direct and the
    k3 estimator, and the chi-square divergence E[rho^2] - 1 (the IS weights' variance)."""
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "rollout_corr/kl": masked_mean(-log_ratio, mask),
        "rollout_corr/k3_kl": masked_mean(torch.exp(safe) - 1.0 - safe, mask),
        "rollout_corr/chi2_token": masked_mean(torch.exp(2.0 * safe), mask) - 1.0,
    }


def _kept_by(rule: RejectionRule, log_ratio: Tensor, mask: Tensor) -> Tensor:
    """1 where `rule` keeps the token (a sequence rule keeps or drops every token of a sequence)."""
    level, _, estimator = rule.option.rpartition("_")
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    token_stat = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}[
        estimator
    ] * mask
    if level == "token":
        stat = token_stat
    elif level == "seq_sum":
        stat = masked_sum(token_stat, mask, dim=-1)[:, None]
    elif level == "seq_mean":
        stat = masked_mean(token_stat, mask, dim=-1)[:, None]
    # seq_max: k2 and k3 are >= 0, so padding's 0 never wins over a real token
    else:
        stat = token_stat.max(dim=-1, keepdim=True).values
    kept = stat <= rule.upper
    if rule.lower is not None:
        kept = kept & (stat >= rule.lower)
    return kept.to(mask.dtype).expand_as(mask)


def _is_weights(
    log_ratio: Tensor, mask: Tensor, p: CorrectionParams
) -> tuple[Tensor, dict[str, Tensor]]:
    if p.is_level == "token":
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * mask
    # sequence: the product of the token ratios, on every token of the sequence
    else:
        seq_log_ratio = masked_sum(log_ratio, mask, dim=-1)[:, None]
        raw = torch.exp(seq_log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * mask
    metrics = {
        # before truncation, as verl logs it
        "rollout_corr/rollout_is_mean": masked_mean(raw, mask),
        "rollout_corr/rollout_is_ratio_fraction_high": masked_mean(
            (raw > p.is_threshold).to(mask.dtype), mask
        ),
    }
    weights = raw.clamp(max=p.is_threshold)
    if p.is_batch_normalize:
        if p.is_level == "token":
            mean = masked_mean(weights, mask)
        # one weight per sequence with a valid token
        else:
            has_tokens = mask.sum(-1) > 0
            mean = (
                weights.max(dim=-1).values[has_tokens].mean()
                if has_tokens.any()
                else weights.new_ones(())
            )
        # as verl: weights that all vanish are left as they are
        if mean > 1e-8:
            weights = weights / mean
    return weights, metrics
