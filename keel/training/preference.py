"""Forward passes over preference pairs: each pair's chosen and rejected in one pass (laid out as
pair_layout says), to summed completion log-probs (DPO) or to one score per sequence (a reward
model)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from keel.algorithms.preference import PairLogProbs
from keel.data.preference import PreferencePair
from keel.training.forward import PLAIN_LM_HEAD, _token_stats, vocab_token_stats
from keel.training.pair_layout import packed_rows, pair_blocks, shared_prompt_mask


@dataclass(frozen=True)
class PairBatch:
    """A micro-batch of pairs as model inputs, and where each completion token sits in them."""

    input_ids: Tensor  # [rows, L]
    position_ids: Tensor  # [rows, L]
    # [rows, L] with padding; None when packed (the positions say where sequences start)
    attention_mask: Tensor | None
    # shared prompt: [2, rows, L], each token's block (-1: padding) and part, from which the 4-D
    # mask is built where the model runs (a [rows, 1, L, L] mask is too large to build on the host)
    shared_prompt_blocks: Tensor | None
    # flat index (row * L + position) of the hidden state that predicts each completion token,
    # the token, its sequence: [N] each
    predict_at: Tensor
    targets: Tensor
    target_sequence: Tensor
    # flat index of the token a reward model reads in each sequence (pair_layout.last_read):
    # [2 * pairs]
    last_token_at: Tensor
    # completion tokens of each sequence: [2 * pairs]
    completion_tokens: Tensor
    # reward_model: each pair's margin, when the data has them: [pairs]
    margins: Tensor | None
    # tokens of the sequences the batch stands for (a shared prompt counted twice), no padding
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
    pairs: list[PreferencePair],
    pad_token_id: int,
    padding_free: bool,
    row_tokens: int,
    share_prompt: bool = False,
) -> PairBatch:
    """Pairs as one micro-batch, in the layout pair_layout describes."""
    blocks = pair_blocks(pairs, share_prompt, pad_token_id)
    lengths = [len(block.tokens) for block in blocks]
    # one length and no shared prompt: a row each, no mask (attention's plain causal path)
    plain = not share_prompt and len(set(lengths)) == 1
    packing = (padding_free or share_prompt) and not plain
    rows = packed_rows(lengths, row_tokens) if packing else [[i] for i in range(len(blocks))]
    width = max(sum(lengths[i] for i in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    block_ids = torch.full((len(rows), width), -1, dtype=torch.long)
    parts = torch.zeros((len(rows), width), dtype=torch.long)
    predict_at, targets, target_sequence = [], [], []
    last_token_at = [0] * (2 * len(pairs))
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            block, span = blocks[i], slice(offset, offset + lengths[i])
            input_ids[r, span] = torch.tensor(block.tokens)
            position_ids[r, span] = torch.tensor(block.positions)
            block_ids[r, span] = i
            parts[r, span] = torch.tensor(block.parts)
            start = r * width + offset
            for by, token, sequence in block.targets:
                predict_at.append(start + by)
                targets.append(token)
                target_sequence.append(sequence)
            for sequence, at in block.last.items():
                last_token_at[sequence] = start + at
            offset += lengths[i]
        # packed rows: the padding after the last block is a sequence of its own
        position_ids[r, offset:] = torch.arange(width - offset)
    target_sequence = torch.tensor(target_sequence)
    margins = [p.margin for p in pairs]
    return PairBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=None if share_prompt or padding_free or plain else (block_ids >= 0).long(),
        shared_prompt_blocks=torch.stack([block_ids, parts]) if share_prompt else None,
        predict_at=torch.tensor(predict_at),
        targets=torch.tensor(targets),
        target_sequence=target_sequence,
        last_token_at=torch.tensor(last_token_at),
        completion_tokens=torch.bincount(target_sequence, minlength=2 * len(pairs)).float(),
        # a row without a margin in data that has them: no margin asked, 0
        margins=None
        if all(m is None for m in margins)
        else torch.tensor([m or 0.0 for m in margins], dtype=torch.float),
        tokens=sum(lengths) + (sum(len(p.prompt_ids) for p in pairs) if share_prompt else 0),
    )


def _inputs(batch: PairBatch) -> dict:
    return {
        "input_ids": batch.input_ids,
        "position_ids": batch.position_ids,
        "attention_mask": batch.attention_mask
        if batch.shared_prompt_blocks is None
        else shared_prompt_mask(*batch.shared_prompt_blocks),
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
    predicting = batch.predict_at
    if getattr(model.config, "model_type", None) in PLAIN_LM_HEAD:
        hidden = model.get_decoder()(**_inputs(batch)).last_hidden_state  # [rows, L, H]
        flat = hidden.reshape(-1, hidden.shape[-1])[predicting]  # [N, H]
        token_log_probs, _, _ = vocab_token_stats(
            model.get_output_embeddings(), flat, batch.targets, 1.0, fused_vocab=fused_vocab
        )
    else:
        logits = model(**_inputs(batch)).logits  # [rows, L, V]
        flat = logits.reshape(-1, logits.shape[-1])[predicting]
        token_log_probs, _, _ = _token_stats(flat, batch.targets, 1.0, False, False)
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
