"""The old-log-prob pass of a batch-invariant rollout (`rollout.batch_invariant`): the engine's
prefill of each whole sequence, in the sampler's arithmetic (invariant.py), from the policy's
current weights. Equal to the sampler's log-probs bit for bit where the weights are those that
sampled (a synchronous step's), and the trainer's old policy either way."""

from __future__ import annotations

import torch
from torch import Tensor

# response positions whose logits [rows, V] are made at once
LOGIT_ROWS = 1024


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
    # a padding row (a rank's share made even) has no response: nothing to score
    scored = [i for i, (_, response) in enumerate(sequences) if response]
    for group in token_groups(scored, sequences, engine.max_num_batched_tokens):
        parts = [sequences[i] for i in group]
        for i, log_probs in zip(group, group_log_probs(engine.runner, parts, temperature)):
            out[i, : len(log_probs)] = log_probs
    return out


def token_groups(indices: list[int], sequences, budget: int) -> list[list[int]]:
    """The sequences in groups of at most `budget` tokens (rollout.max_num_batched_tokens, a
    prefill pass's), each at least one sequence: a group's cache and activations are the pass's."""
    groups, tokens = [], budget
    for i in indices:
        length = sum(map(len, sequences[i]))
        if tokens + length > budget:
            groups.append([])
            tokens = 0
        groups[-1].append(i)
        tokens += length
    return groups


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
        # the positions whose next token is a response token, LOGIT_ROWS at a time
        before = hidden[row, len(prompt) - 1 : len(prompt) + len(response) - 1]
        ids = torch.tensor(response, dtype=torch.long, device=runner.device)
        yield torch.cat(
            [
                runner.log_probs(
                    runner.logits(before[i : i + LOGIT_ROWS]), ids[i : i + LOGIT_ROWS], temperature
                ).cpu()
                for i in range(0, len(response), LOGIT_ROWS)
            ]
        )
