"""SFT data: chat examples tokenized with a loss mask that covers assistant tokens only."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from keel.errors import DATA_COLUMN, NO_ASSISTANT_TURN, NO_CHAT_TEMPLATE, SFT_TOO_LONG, KeelError
from keel.errors.fixes import overrides, setting

RESPONSE_NAMES = ("response", "answer", "output", "completion", "solution", "target")
PROMPT_NAMES = ("prompt", "question", "instruction", "input", "query", "problem")


@dataclass
class SFTExample:
    input_ids: list[int]
    # 1 on tokens the model is trained to produce (assistant turns)
    loss_mask: list[int]


@dataclass
class SFTStats:
    total: int
    truncated: int
    name: str = "train"

    def summary(self) -> str:
        return f"{self.name} SFT data: {self.total} examples, {self.truncated} truncated"


def row_messages(
    row: dict, messages_key: str, prompt_key: str, response_key: str, i: int
) -> list[dict]:
    """A row as chat messages: a messages column, or a prompt (string or chat) plus a response."""
    if messages_key in row and row[messages_key] is not None:
        return list(row[messages_key])
    if prompt_key in row and response_key in row:
        prompt = row[prompt_key]
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return turns + [{"role": "assistant", "content": row[response_key]}]
    raise KeelError(
        DATA_COLUMN,
        f"SFT row {i} has neither {messages_key!r} nor both {prompt_key!r} and "
        f"{response_key!r}; its columns are {sorted(row)}",
        _columns_fix(row),
    )


def _columns_fix(row: dict) -> str:
    """The row's chat column as data.messages_key, else its prompt- and response-named columns."""
    chats = [
        k
        for k, v in row.items()
        if isinstance(v, list)
        and v
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in v)
    ]
    prompts = [k for k in row if k.lower() in PROMPT_NAMES]
    responses = [k for k in row if k.lower() in RESPONSE_NAMES]
    if len(chats) == 1:
        return f"set {setting('data.messages_key', chats[0])} (the row's chat column)"
    if len(prompts) == 1 and len(responses) == 1:
        return (
            f"set {overrides({'data.prompt_key': prompts[0], 'data.response_key': responses[0]})}"
        )
    return "set data.messages_key, or data.prompt_key and data.response_key, to your columns"


def tokenize_conversation(messages: list[dict], tokenizer) -> SFTExample:
    """Template the whole chat; mark the tokens each assistant turn adds as the ones to learn.

    An assistant turn's tokens are those between the chat rendered up to the turn's opener
    (`add_generation_prompt=True`) and the chat rendered through the turn, so whatever the template
    puts around a turn (role headers, end-of-turn token) is handled without knowing its format.
    """

    def ids_of(turns: list[dict], open_assistant: bool) -> list[int]:
        text = tokenizer.apply_chat_template(
            turns, tokenize=False, add_generation_prompt=open_assistant
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    input_ids = ids_of(messages, open_assistant=False)
    loss_mask = [0] * len(input_ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(ids_of(messages[:turn], open_assistant=True))
        end = len(ids_of(messages[: turn + 1], open_assistant=False))
        loss_mask[start:end] = [1] * (end - start)
    return SFTExample(input_ids, loss_mask)


def build_sft_dataset(
    rows: list[dict],
    tokenizer,
    *,
    messages_key: str = "messages",
    prompt_key: str = "prompt",
    response_key: str = "response",
    max_length: int = 1024,
    truncation: str = "error",
    name: str = "train",
) -> tuple[list[SFTExample], SFTStats]:
    if tokenizer.chat_template is None:
        raise KeelError(
            NO_CHAT_TEMPLATE, "SFT data is chat messages, but the tokenizer has no chat template"
        )
    examples = []
    for i, row in enumerate(rows):
        examples.append(
            tokenize_conversation(
                row_messages(row, messages_key, prompt_key, response_key, i), tokenizer
            )
        )
        if not any(examples[-1].loss_mask):
            raise KeelError(
                NO_ASSISTANT_TURN,
                f"{name} SFT row {i} has no assistant tokens to learn from",
                f"give row {i} of the {name} files an assistant message with content",
            )
    over = [i for i, example in enumerate(examples) if len(example.input_ids) > max_length]
    longest = max((len(examples[i].input_ids) for i in over), default=0)
    if over and truncation == "error":
        raise KeelError(
            SFT_TOO_LONG,
            f"{name} SFT row {over[0]} is {len(examples[over[0]].input_ids)} tokens, over "
            f"data.max_length={max_length}; {len(over)} of {len(examples)} examples are "
            f"over, the longest {longest} tokens",
            f"set {setting('data.max_length', longest)} (the longest example), or "
            f"{setting('data.truncation', 'right')} to keep each example's start",
        )
    for i in over:
        examples[i] = _truncate(examples[i], max_length, truncation, i, name, longest)
    return examples, SFTStats(len(examples), len(over), name)


def _truncate(
    example: SFTExample, limit: int, truncation: str, i: int, name: str, longest: int
) -> SFTExample:
    cut = slice(-limit, None) if truncation == "left" else slice(0, limit)
    kept = SFTExample(example.input_ids[cut], example.loss_mask[cut])
    if not any(kept.loss_mask):
        other = "right" if truncation == "left" else "left"
        raise KeelError(
            NO_ASSISTANT_TURN,
            f"{name} SFT row {i}: truncation={truncation} to {limit} tokens removes every "
            "assistant token",
            f"set {setting('data.max_length', longest)} (the longest example, whole), or "
            f"{setting('data.truncation', other)}",
        )
    return kept


def collate_sft(examples: list[SFTExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example: input_ids, attention_mask, loss_mask, each [B, L]."""
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[row, :n] = torch.tensor(e.input_ids)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(e.loss_mask)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
