"""Forward passes over preference pairs: each pair's chosen and rejected in one pass, packed
without padding, to summed completion log-probs (DPO) or to one score per sequence (a reward
model).

Sequence 2k of a batch is pair k's prompt and chosen completion, 2k + 1 its prompt and rejected.
Packed rows hold whole sequences back to back, each with positions from 0: transformers keeps
attention within a sequence when it sees the positions restart and no attention mask (its packed
sequence detection), so a packed pass equals each sequence's own pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from keel.algorithms.preference import PairLogProbs
from keel.data.preference import PreferencePair
from keel.training.forward import PLAIN_LM_HEAD, _token_stats, vocab_token_stats


@dataclass(frozen=True)
class PairBatch:
    """A micro-batch of pairs as model inputs, and where each completion token sits in them."""

    input_ids: Tensor  # [rows, L]
    position_ids: Tensor  # [rows, L]
    # [rows, L] with padding; None when packed (the positions say where sequences start)
    attention_mask: Tensor | None
    # flat index (row * L + position) of each completion token, its token, its sequence: [N] each
    target_at: Tensor
    targets: Tensor
    target_sequence: Tensor
    # flat index of each sequence's last token: [2 * pairs]
    last_token_at: Tensor
    # completion tokens of each sequence: [2 * pairs]
    completion_tokens: Tensor
    # reward_model: each pair's margin, when the data has them: [pairs]
    margins: Tensor | None
    # tokens the batch holds, padding left out
    tokens: int

    @property
    def pairs(self) -> int:
        return self.last_token_at.shape[0] // 2

    def to(self, device: torch.device) -> PairBatch:
        moved = {
            name: value.to(device) if isinstance(value, Tensor) else value
            for name, value in vars(self).items()
        }
        return PairBatch(**moved)


def collate_pairs(
    pairs: list[PreferencePair], pad_token_id: int, padding_free: bool, row_tokens: int
) -> PairBatch:
    """Pairs as one micro-batch: packed into rows of at most `row_tokens` (padding_free), else one
    right-padded row per sequence."""
    # each sequence with its first target: with no prompt, its first token has none before it to
    # predict it (TRL leaves it out too), rather than the previous sequence's last
    sequences = [
        (p.prompt_ids + completion, max(len(p.prompt_ids), 1))
        for p in pairs
        for completion in (p.chosen_ids, p.rejected_ids)
    ]
    # Sequences of one length need neither padding nor packing: a row each, and attention takes
    # its plain causal path (packed rows cost a mask over the whole row).
    same_length = len({len(ids) for ids, _ in sequences}) == 1
    rows = (
        _packed_rows(sequences, row_tokens)
        if padding_free and not same_length
        else [[i] for i in range(len(sequences))]
    )
    width = max(sum(len(sequences[i][0]) for i in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention_mask = (
        None if padding_free or same_length else torch.zeros((len(rows), width), dtype=torch.long)
    )
    target_at, target_sequence, last_token_at = [], [], [0] * len(sequences)
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            ids, prompt_len = sequences[i]
            n = len(ids)
            input_ids[r, offset : offset + n] = torch.tensor(ids)
            position_ids[r, offset : offset + n] = torch.arange(n)
            if attention_mask is not None:
                attention_mask[r, offset : offset + n] = 1
            start = r * width + offset
            target_at.extend(range(start + prompt_len, start + n))
            target_sequence.extend([i] * (n - prompt_len))
            last_token_at[i] = start + n - 1
            offset += n
        # the padding after the last sequence is a sequence of its own for the packed mask
        position_ids[r, offset:] = torch.arange(width - offset)
    target_at_t = torch.tensor(target_at)
    margins = [p.margin for p in pairs]
    return PairBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        target_at=target_at_t,
        targets=input_ids.reshape(-1)[target_at_t],
        target_sequence=torch.tensor(target_sequence),
        last_token_at=torch.tensor(last_token_at),
        completion_tokens=torch.tensor([len(ids) - p for ids, p in sequences], dtype=torch.float),
        # a row without a margin in data that has them: no margin asked, 0
        margins=None
        if all(m is None for m in margins)
        else torch.tensor([m or 0.0 for m in margins], dtype=torch.float),
        tokens=sum(len(ids) for ids, _ in sequences),
    )


def _packed_rows(sequences: list[tuple[list[int], int]], row_tokens: int) -> list[list[int]]:
    """Sequences in order, each into the first row with room (a sequence longer than a row gets a
    row of its own)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, (ids, _) in enumerate(sequences):
        fits = next((r for r, left in enumerate(room) if left >= len(ids)), None)
        if fits is None:
            rows.append([i])
            room.append(row_tokens - len(ids))
        else:
            rows[fits].append(i)
            room[fits] -= len(ids)
    return rows


def _inputs(batch: PairBatch) -> dict:
    return {
        "input_ids": batch.input_ids,
        "position_ids": batch.position_ids,
        "attention_mask": batch.attention_mask,
        "use_cache": False,
    }


def pair_log_probs(
    model, batch: PairBatch, fused_vocab: bool = False
) -> tuple[PairLogProbs, Tensor]:
    """Summed completion log-probs of each pair's two sequences, and each completion token's
    log-prob [N]. lm_head runs only on the positions that predict a completion token, in chunks
    (training.forward); `fused_vocab`: its vocabulary arithmetic compiled (GPU)."""
    device = next(model.parameters()).device
    batch = batch.to(device)
    # position t predicts token t + 1
    predicting = batch.target_at - 1
    if getattr(model.config, "model_type", None) in PLAIN_LM_HEAD:
        hidden = model.get_decoder()(**_inputs(batch)).last_hidden_state  # [rows, L, H]
        flat = hidden.reshape(-1, hidden.shape[-1])[predicting]  # [N, H]
        token_log_probs, _ = vocab_token_stats(
            model.get_output_embeddings(), flat, batch.targets, 1.0, fused_vocab=fused_vocab
        )
    else:
        logits = model(**_inputs(batch)).logits  # [rows, L, V]
        flat = logits.reshape(-1, logits.shape[-1])[predicting]
        token_log_probs, _ = _token_stats(flat, batch.targets, 1.0, False, False)
    sums = torch.zeros(2 * batch.pairs, device=device, dtype=token_log_probs.dtype)
    sums = sums.index_add(0, batch.target_sequence, token_log_probs)
    tokens = batch.completion_tokens
    return PairLogProbs(sums[0::2], sums[1::2], tokens[0::2], tokens[1::2]), token_log_probs


def pair_scores(model, batch: PairBatch) -> tuple[Tensor, Tensor]:
    """A sequence-classification model's score of each pair's chosen and rejected: [pairs] each,
    read at each sequence's last token (as transformers' own head reads an unpadded sequence)."""
    device = next(model.parameters()).device
    batch = batch.to(device)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(base, base.base_model_prefix)
    hidden = decoder(**_inputs(batch)).last_hidden_state  # [rows, L, H]
    last = hidden.reshape(-1, hidden.shape[-1])[batch.last_token_at]  # [2 * pairs, H]
    scores = base.score(last).squeeze(-1).float()  # [2 * pairs]
    return scores[0::2], scores[1::2]
