"""The old-log-prob pass of a batch-invariant rollout (`rollout.batch_invariant`): the engine's
prefill of each whole sequence, in the sampler's arithmetic (invariant.py), from the policy's
current weights. Equal to the sampler's log-probs bit for bit where the weights are those that
sampled (a synchronous step's), and the trainer's old policy either way."""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def score(engine, batch, temperature: float) -> Tensor:
    """The log-prob of every response token of `batch` (a GeneratedBatch's fields) under the native
    `engine`'s weights at `temperature` -> [N, R] float32 on the host, 0 past each response."""
    attended = batch.response_attention
    attended = batch.response_mask if attended is None else attended
    out = torch.zeros(batch.response_ids.shape, dtype=torch.float32)
    for i in range(len(out)):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
        response = batch.response_ids[i][: int(attended[i].sum())].tolist()
        out[i, : len(response)] = sequence_log_probs(engine.runner, prompt, response, temperature)
    return out


def sequence_log_probs(runner, prompt: list[int], response: list[int], temperature: float):
    """The log-probs of `response`'s tokens after `prompt`, from one prefill of both into a cache
    of their own."""
    tokens = prompt + response
    cache = (1, runner.kv_heads, len(tokens), runner.head_dim)
    k = [torch.zeros(cache, dtype=runner.dtype, device=runner.device) for _ in range(runner.layers)]
    v = [torch.zeros(cache, dtype=runner.dtype, device=runner.device) for _ in range(runner.layers)]
    hidden, _ = runner.prefill_hidden(k, v, [(0, 0, tokens)])
    # the positions whose next token is a response token
    logits = runner.logits(hidden[0, len(prompt) - 1 : len(tokens) - 1])
    ids = torch.tensor(response, device=runner.device)
    return runner.log_probs(logits, ids, temperature).cpu()
