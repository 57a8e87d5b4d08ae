"""Sampling from a batch of logits on the device, with no host synchronisation."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from keel.types import SamplingParams

# vocabulary entries per block of two-stage sampling
SAMPLE_BLOCK = 1024


class Pickers(NamedTuple):
    """The functions that read the logits (the engine passes torch.compile'd copies on GPU)."""

    token: Callable
    blocked: Callable


def sample(
    logits: Tensor,
    params: SamplingParams,
    pickers: Pickers | None = None,
    block: int = SAMPLE_BLOCK,
    whole_row_log_prob: bool = False,
) -> tuple[Tensor, Tensor]:
    """(token [B], its log-prob under the temperature-scaled distribution [B]) from logits [B, V].

    The log-prob is taken from the full distribution, not the top-k/top-p truncated one: it is
    what the trainer recomputes, so the sampler/trainer gap measures numerics only (as the hf
    engine does). Sampling is Gumbel-max, argmax(logits - log E) with E ~ Exp(1): a draw from the
    softmax. Noise for every vocabulary entry costs more than the rest of the step's sampling, so
    plain sampling (no top-k/top-p) draws in two exact stages (pick_blocked). With
    `whole_row_log_prob` (a batch-invariant rollout) every branch's log-prob is then taken again as
    the old-log-prob pass takes it, eagerly, one logsumexp of the whole row (token_log_prob). The
    noise is drawn here, eagerly: eager RNG advances correctly under CUDA graph replay.
    """
    pickers = pickers or Pickers(pick_token, pick_blocked)
    token, log_prob, temperature = _draw(logits, params, pickers, block)
    if whole_row_log_prob:
        # eagerly, as the pass does: a compiled picker may divide by the reciprocal, or fuse
        log_prob = token_log_prob(logits.float() / temperature, token)
    return token, log_prob


def _draw(
    logits: Tensor, params: SamplingParams, pickers: Pickers, block: int
) -> tuple[Tensor, Tensor, float]:
    """(token, its log-prob, the temperature the log-prob is under) by the pickers."""
    greedy = not params.do_sample or params.temperature == 0
    if greedy:
        return (*pickers.token(logits, None, None, 1.0), 1.0)
    rows, vocab = logits.shape

    def noise(*shape: int) -> Tensor:
        return torch.empty(shape, device=logits.device, dtype=torch.float32).exponential_()

    if (params.top_k > 0 and params.top_k < vocab) or params.top_p < 1.0:
        filtered = top_k_top_p(logits.float() / params.temperature, params.top_k, params.top_p)
        picked = pickers.token(logits, filtered, noise(rows, vocab), params.temperature)
    else:
        picked = pickers.blocked(
            logits, noise(rows, -(-vocab // block)), noise(rows, block), params.temperature
        )
    return (*picked, params.temperature)


def pick_token(
    logits: Tensor, filtered: Tensor | None, noise: Tensor | None, temperature: float
) -> tuple[Tensor, Tensor]:
    """Greedy (no noise) or Gumbel-max over `filtered` (default: all of the scaled logits), and
    the token's log-prob under the full scaled distribution."""
    scaled = logits.float() / temperature
    candidates = scaled if filtered is None else filtered
    if noise is None:
        token = candidates.argmax(-1)
    else:
        token = (candidates - noise.clamp(min=1e-30).log()).argmax(-1)
    return token, token_log_prob(scaled, token)


def token_log_prob(scaled: Tensor, token: Tensor) -> Tensor:
    """log softmax(scaled)[token] for each row of the scaled logits [B, V]."""
    return scaled.gather(-1, token.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


def pick_blocked(
    logits: Tensor, block_noise: Tensor, inner_noise: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    """Gumbel-max in two stages: a block of the vocabulary, drawn by its mass (the logsumexp of
    its logits), then a token of that block by its logit. P(block) x P(token | block) is the
    softmax, exactly, with noise for the blocks and one block instead of for every token; the
    per-block logsumexps also give the log-prob's normaliser. One pass over the logits."""
    rows, vocab = logits.shape
    blocks, size = block_noise.shape[1], inner_noise.shape[1]
    scaled = F.pad(logits.float() / temperature, (0, blocks * size - vocab), value=float("-inf"))
    scaled = scaled.view(rows, blocks, size)
    block_mass = torch.logsumexp(scaled, dim=-1)  # [B, blocks]
    chosen = (block_mass - block_noise.clamp(min=1e-30).log()).argmax(-1)  # [B]
    inner = scaled.gather(1, chosen.view(rows, 1, 1).expand(rows, 1, size)).squeeze(1)  # [B, size]
    offset = (inner - inner_noise.clamp(min=1e-30).log()).argmax(-1)
    log_prob = inner.gather(-1, offset.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(
        block_mass, dim=-1
    )
    return chosen * size + offset, log_prob


def top_k_top_p(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Logits outside the top k, or outside the smallest set holding top_p of the mass, set to
    -inf (the same rule as transformers' warpers, applied top-k first)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        # the mass before this token already exceeds top_p
        outside = probs.cumsum(-1) - probs > top_p
        ordered = ordered.masked_fill(outside, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    return logits
