"""The old-log-prob pass of a batch-invariant rollout (`rollout.batch_invariant`): the engine's
prefill of each whole sequence, in the sampler's arithmetic (invariant.py), from the policy's
current weights. Equal to the sampler's log-probs bit for bit where the weights are those that
sampled (a synchronous step's), and the trainer's old policy either way."""

from __future__ import annotations

import torch
from torch import Tensor

# sequences prefilled together (their cache is theirs alone, freed after)
GROUP = 16


@torch.no_grad()
def score(engine, batch, temperature: float) -> Tensor:
    """The log-prob of every response token of `batch` (a GeneratedBatch's fields) under the native
    `engine`'s weights at `temperature` -> [N, R] float32 on the host, 0 past each response."""
    attended = batch.response_attention
    attended = batch.response_mask if attended is None else attended
    sequences = [
        (
            batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist(),
            batch.response_ids[i][: int(attended[i].sum())].tolist(),
        )
        for i in range(len(batch.response_ids))
    ]
    out = torch.zeros(batch.response_ids.shape, dtype=torch.float32)
    for start in range(0, len(sequences), GROUP):
        group = sequences[start : start + GROUP]
        for i, log_probs in enumerate(group_log_probs(engine.runner, group, temperature)):
            out[start + i, : len(log_probs)] = log_probs
    return out


def group_log_probs(runner, group: list[tuple[list[int], list[int]]], temperature: float):
    """Each (prompt, response)'s response log-probs, from one prefill of the group's whole
    sequences into a cache of their own."""
    longest = max(len(prompt) + len(response) for prompt, response in group)
    cache = (len(group), runner.kv_heads, longest, runner.head_dim)
    k = [torch.zeros(cache, dtype=runner.dtype, device=runner.device) for _ in range(runner.layers)]
    v = [torch.zeros(cache, dtype=runner.dtype, device=runner.device) for _ in range(runner.layers)]
    pieces = [(row, 0, prompt + response) for row, (prompt, response) in enumerate(group)]
    hidden, _ = runner.prefill_hidden(k, v, pieces)
    for row, (prompt, response) in enumerate(group):
        # the positions whose next token is a response token
        logits = runner.logits(hidden[row, len(prompt) - 1 : len(prompt) + len(response) - 1])
        ids = torch.tensor(response, device=runner.device)
        yield runner.log_probs(logits, ids, temperature).cpu()
