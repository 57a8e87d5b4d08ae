"""Sampling from a batch of logits on the device, with no host synchronisation."""

from __future__ import annotations

import torch
from torch import Tensor

from keel.types import SamplingParams


def sample(logits: Tensor, params: SamplingParams, pick=None) -> tuple[Tensor, Tensor]:
    """(token [B], its log-prob under the temperature-scaled distribution [B]) from logits [B, V].

    The log-prob is taken from the full distribution, not the top-k/top-p truncated one: it is
    what the trainer recomputes, so the sampler/trainer gap measures numerics only (as the hf
    engine does). Sampling is Gumbel-max, argmax(logits - log E) with E ~ Exp(1): a draw from the
    softmax. Every step touches the [B, V] logits a handful of times, so each pass counts: `pick`
    (pick_token, or the engine's compiled copy of it, which fuses them) reads them twice.
    """
    pick = pick or pick_token
    greedy = not params.do_sample or params.temperature == 0
    temperature = 1.0 if greedy else params.temperature
    if greedy:
        return pick(logits, None, None, temperature)
    # The noise is drawn outside `pick`: eager RNG advances correctly under CUDA graph replay.
    noise = torch.empty(logits.shape, device=logits.device, dtype=torch.float32).exponential_()
    filtered = None
    if (params.top_k > 0 and params.top_k < logits.shape[-1]) or params.top_p < 1.0:
        filtered = top_k_top_p(logits.float() / temperature, params.top_k, params.top_p)
    return pick(logits, filtered, noise, temperature)


def pick_token(logits: Tensor, filtered: Tensor | None, noise: Tensor | None,
               temperature: float) -> tuple[Tensor, Tensor]:
    """Greedy (no noise) or Gumbel-max over `filtered` (default: all of the scaled logits), and
    the token's log-prob under the full scaled distribution."""
    scaled = logits.float() / temperature
    candidates = scaled if filtered is None else filtered
    if noise is None:
        token = candidates.argmax(-1)
    else:
        token = (candidates - noise.clamp(min=1e-30).log()).argmax(-1)
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
