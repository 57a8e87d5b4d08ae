"""How a micro-batch of pairs is laid out as model inputs.

Sequence 2k of a batch is pair k's prompt and chosen completion, 2k + 1 its prompt and rejected.
Three layouts, each equal to every sequence's own pass:
- shared prompt (`share_prompt`): a pair is one block, its prompt once, then chosen, then rejected
  at the positions that follow the prompt. A 4-D mask lets each completion see the prompt and
  itself, never the other completion, so the prompt is computed once per pair instead of twice.
- sequences packed (`padding_free`): whole sequences back to back, each with positions from 0
  and no attention mask; transformers keeps attention within each (its packed-sequence
  detection).
- padded: one right-padded row per sequence, with a 2-D attention mask.
Blocks are packed into rows of at most `row_tokens`, first fit, unless padded. Sequences of one
length with no shared prompt need no padding: a row each, and attention's plain causal path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from keel.data.preference import PreferencePair
from keel.training import shared_prompt

# Each token's part of its block: the prompt, a completion (in a shared block, the chosen one),
# and a shared block's rejected completion, which never sees the chosen.
PROMPT, COMPLETION, REJECTED = 0, 1, 2


@dataclass
class Block:
    """Tokens placed together in a row, and what is read from them (offsets within the block)."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    parts: list[int] = field(default_factory=list)
    # (offset whose hidden state predicts it, the token, its sequence) per completion token
    targets: list[tuple[int, int, int]] = field(default_factory=list)
    # sequence -> offset of the token a reward model reads (last_read)
    last: dict[int, int] = field(default_factory=dict)


def last_read(ids: list[int], pad_token_id: int | None) -> int:
    """Where transformers' sequence classifiers read a sequence: its last token that is not the
    pad token (with pad = EOS, the token before a closing EOS), as keel's reward model scores."""
    return next((i for i in range(len(ids) - 1, -1, -1) if ids[i] != pad_token_id), len(ids) - 1)


def sequence_block(
    prompt: list[int], completion: list[int], sequence: int, pad_token_id: int | None
) -> Block:
    # with no prompt the first token has nothing before it to predict it (TRL leaves it out too)
    first = max(len(prompt), 1)
    ids = prompt + completion
    return Block(
        ids,
        list(range(len(ids))),
        [PROMPT] * len(prompt) + [COMPLETION] * len(completion),
        [(t - 1, ids[t], sequence) for t in range(first, len(ids))],
        {sequence: last_read(ids, pad_token_id)},
    )


def shared_prompt_block(pair: PreferencePair, k: int, pad_token_id: int | None) -> Block:
    """Prompt, chosen, rejected; rejected's first token is predicted by the prompt's last."""
    p, c = pair.prompt_ids, pair.chosen_ids
    block = sequence_block(p, c, 2 * k, pad_token_id)
    start = len(block.tokens)
    block.tokens += pair.rejected_ids
    block.positions += list(range(len(p), len(p) + len(pair.rejected_ids)))
    block.parts += [REJECTED] * len(pair.rejected_ids)
    predicted_by = [len(p) - 1] + list(range(start, start + len(pair.rejected_ids) - 1))
    block.targets += [
        (by, token, 2 * k + 1)
        for by, token in zip(predicted_by, pair.rejected_ids, strict=True)
        if by >= 0
    ]
    read = last_read(p + pair.rejected_ids, pad_token_id)
    block.last[2 * k + 1] = read if read < len(p) else start + read - len(p)
    return block


def pair_blocks(
    pairs: list[PreferencePair], share_prompt: bool, pad_token_id: int | None
) -> list[Block]:
    if share_prompt:
        return [shared_prompt_block(pair, k, pad_token_id) for k, pair in enumerate(pairs)]
    return [
        sequence_block(pair.prompt_ids, completion, 2 * k + side, pad_token_id)
        for k, pair in enumerate(pairs)
        for side, completion in enumerate((pair.chosen_ids, pair.rejected_ids))
    ]


def packed_rows(lengths: list[int], row_tokens: int) -> list[list[int]]:
    """Blocks in order, each into the first row with room (a longer one gets a row of its own)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, length in enumerate(lengths):
        fits = next((r for r, left in enumerate(room) if left >= length), None)
        if fits is None:
            rows.append([i])
            room.append(row_tokens - length)
        else:
            rows[fits].append(i)
            room[fits] -= length
    return rows


def shared_prompt_mask(block_ids: Tensor, parts: Tensor) -> Tensor:
    """[rows, 1, L, L] boolean: within its block, a token sees what shared_prompt's rule lets it
    (the earlier tokens of the prompt and of its own completion: a rejected token never sees the
    chosen completion); padding (block -1) sees only itself. A block is laid out prompt, then
    chosen, then rejected (shared_prompt_block), which the rule's causality relies on."""
    # the parts as shared_prompt's segments: the prompt, the chosen (0) or rejected (1) completion
    segments = torch.where(parts == PROMPT, shared_prompt.PROMPT, (parts == REJECTED).long())
    segments = segments.masked_fill(block_ids < 0, shared_prompt.PADDING)
    index = torch.arange(block_ids.shape[1], device=block_ids.device)
    same_block = block_ids[:, :, None] == block_ids[:, None, :]
    return (same_block & shared_prompt.allowed(segments, index[:, None], index[None, :]))[:, None]
