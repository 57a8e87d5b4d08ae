"""The data's own responses, for GKD's off-policy steps (distillation.gkd.lmbda < 1): each prompt
row's distillation.response_key column, and a batch of them after their prompts, as generation
would have given it. keel/trainer/data_responses.py decides which steps train on them."""

from __future__ import annotations

import torch

from keel.config.schema import KeelConfig
from keel.errors import RESPONSE_COLUMN, KeelError
from keel.errors.fixes import setting
from keel.types import GeneratedBatch, PromptBatch, PromptRecord


def trains_on_responses(cfg: KeelConfig) -> bool:
    """Whether some steps train on the data's responses: gkd with lmbda < 1."""
    d = cfg.distillation
    return cfg.teacher_enabled and d.mode == "gkd" and d.gkd.lmbda < 1


def response_texts(
    rows: list[dict], records: list[PromptRecord], cfg: KeelConfig
) -> dict[int, str]:
    """Each record's response (its row's distillation.response_key), by row index; a row without
    a string there raises RESPONSE_COLUMN."""
    key = cfg.distillation.response_key
    texts = {}
    for record in records:
        row = rows[record.index] if record.index < len(rows) else {}
        text = row.get(key)
        if not isinstance(text, str):
            raise _missing_response(record.index, row, cfg)
        texts[record.index] = text
    return texts


def _missing_response(index: int, row: dict, cfg: KeelConfig) -> KeelError:
    key, lmbda = cfg.distillation.response_key, cfg.distillation.gkd.lmbda
    held = (
        "no such column"
        if key not in row
        else f"a value of type {type(row[key]).__name__}, not a string"
    )
    # a text column the row has beside the prompt's: where its completions likely are
    not_responses = (cfg.data.prompt_key, "data_source")
    others = [k for k, v in row.items() if isinstance(v, str) and k not in not_responses]
    options = [f"set {setting('distillation.response_key', others[0])}"] if len(others) == 1 else []
    options.append(f"add a {key!r} column (the prompt's completion) to every row")
    options.append(f"set {setting('distillation.gkd.lmbda', 1.0)} (the student's samples alone)")
    return KeelError(
        RESPONSE_COLUMN,
        f"train data row {index} has {held} at distillation.response_key={key!r}, which "
        f"distillation.gkd.lmbda={lmbda} trains on in a share of the steps; the row's columns "
        f"are {sorted(row)}",
        ", or ".join(options),
    )


def data_batch(
    prompts: PromptBatch, responses: list[str], tokenizer, max_response_length: int
) -> GeneratedBatch:
    """The prompts answered with `responses` (one per prompt row), as generation would have:
    EOS appended, cut at max_response_length (truncated then), right-padded, texts decoded from
    the tokens kept. from_data marks every row; sampling_log_probs are 0."""
    encoded = tokenizer(responses, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    # a response saved with its EOS (SFT-style text) keeps that one: generation stops at the first
    ids = [e if e[-1:] == [eos] else e + [eos] for e in encoded]
    kept = [i[:max_response_length] for i in ids]
    width = max(len(k) for k in kept)
    response_ids = torch.full((len(kept), width), tokenizer.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((len(kept), width), dtype=torch.long)
    for row, tokens in enumerate(kept):
        response_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        response_mask[row, : len(tokens)] = 1
    return GeneratedBatch(
        prompt_ids=prompts.input_ids,
        prompt_mask=prompts.attention_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        sampling_log_probs=torch.zeros(response_ids.shape),
        group_index=torch.tensor([r.index for r in prompts.records]),
        records=list(prompts.records),
        response_texts=tokenizer.batch_decode(kept, skip_special_tokens=True),
        truncated=torch.tensor([len(i) > max_response_length for i in ids]),
        from_data=torch.ones(len(kept), dtype=torch.bool),
    )
