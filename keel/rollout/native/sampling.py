"""Sampling from a batch of logits on the device, with no host synchronisation."""

from __future__ import annotations

import torch
from torch import Tensor

from keel.types import SamplingParams


def sample(logits: Tensor, params: SamplingParams) -> tuple[Tensor, Tensor]:
    """(token [B], its log-prob under the temperature-scaled distribution [B]) from logits [B, V].

    The log-prob is taken from the full distribution, not the top-k/top-p truncated one: it is
    what the trainer recomputes, so the sampler/trainer gap measures numerics only (as the hf
    engine does). Sampling is Gumbel-max, argmax(logits - log E) with E ~ Exp(1): a draw from the
    softmax. Every step touches the [B, V] logits a handful of times, so each pass counts: the
    log-prob comes from one logsumexp, not a full log_softmax.
    """
    greedy = not params.do_sample or params.temperature == 0
    scaled = logits.float()
    if not greedy and params.temperature != 1.0:
        scaled = scaled / params.temperature
    if greedy:
        token = scaled.argmax(-1)
    else:
        filtered = top_k_top_p(scaled, params.top_k, params.top_p)
        noise = torch.empty_like(filtered).exponential_().clamp_(min=1e-30).log_()
        token = (filtered - noise).argmax(-1)
    log_prob = scaled.gather(-1, token.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    return token, log_prob


def top_k_top_p(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Logits outside the top k, or outside the smallest set holding top_p of the mass, set to
    -inf (the same rule as transformers' warpers, applied top-k first)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        outside = probs.cumsum(-1) - probs > top_p  # the mass before this token already exceeds top_p
        ordered = ordered.masked_fill(outside, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    return logits
