"""Masked reductions shared by the advantage estimators, losses and KL penalties.

Masks may be bool, int or float; 1 marks a real token, 0 padding. The helpers multiply by the
mask instead of indexing, so shapes stay static (no host sync for a data-dependent size). Padded
values must therefore be finite: inf * 0 is nan.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    masked = x * mask.to(x.dtype)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over the positions where `mask` is 1; an all-padding row gives 0, not nan.

    The clamp matters for seq-level reductions (`dim=-1`): a micro-batch may hold a row with no
    response tokens, and one nan would poison the whole loss.
    """
    count = masked_sum(torch.ones_like(x), mask, dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance over all masked positions (a scalar), Bessel-corrected when `unbiased`."""
    n = mask.to(x.dtype).sum()
    if n < 2:
        # verl divides by n - 1 regardless and returns nan; one token has no spread to measure, and
        # whitening it then gives 0 (x - mean = 0) instead of a nan that poisons the loss.
        return torch.zeros((), dtype=x.dtype, device=x.device)
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return var * n / (n - 1) if unbiased else var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) with statistics over the masked positions only.

    As verl's, padded positions are transformed too but not zeroed; callers multiply by the mask.
    `shift_mean=False` rescales but keeps the original mean.
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def entropy_from_logits(logits: Tensor, lse: Tensor | None = None) -> Tensor:
    """Entropy of the categorical distribution per position: [..., V] -> [...].

    H = logsumexp(z) - sum(softmax(z) * z), which avoids log(softmax) underflowing to -inf for
    tokens of negligible probability. `lse` (logsumexp(z), if the caller has it) saves a pass.
    """
    lse = torch.logsumexp(logits, dim=-1) if lse is None else lse
    probs = torch.exp(logits - lse.unsqueeze(-1))  # [..., V]
    return lse - (probs * logits).sum(dim=-1)
