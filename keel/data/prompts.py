"""Prompt datasets in verl's schema: load parquet/JSONL rows, template and tokenize them, collate.

A row holds `prompt` (chat messages `[{"role", "content"}, ...]` or a plain string),
`data_source`, `reward_model.ground_truth` and `extra_info`; only the prompt is required.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from keel.errors import (
    DATA_COLUMN,
    DATA_EMPTY,
    DATA_FILE,
    NO_CHAT_TEMPLATE,
    PROMPT_TOO_LONG,
    KeelError,
)
from keel.errors.fixes import maker_of, nearby_file, setting

# the records this module makes, defined with the others
from keel.types import PromptBatch, PromptRecord

PathLike = str | os.PathLike
TRUNCATION_MODES = ("error", "left", "right")


# --- loading ----------------------------------------------------------------------------------


def load_rows(paths: PathLike | list[PathLike], key: str | None = None) -> list[dict]:
    """Read every file in order and concatenate their rows; `key` is the config key that names
    them."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    missing = next((str(p) for p in paths if not Path(p).is_file()), None)
    if missing is not None:
        raise KeelError(
            DATA_FILE,
            f"dataset file {missing!r} ({key or 'given'}) does not exist or is not a file",
            missing_file_fix(missing, [str(p) for p in paths], key),
        )
    rows: list[dict] = []
    for path in paths:
        rows.extend(_load_file(Path(path)))
    # an empty dataset would otherwise fail deep inside the tokenizer
    if not rows:
        raise KeelError(DATA_EMPTY, f"the dataset files {[str(p) for p in paths]} hold no rows")
    return rows


def missing_file_fix(missing: str, paths: list[str], key: str | None) -> str | None:
    """A file there is, named like the missing one; else the script that writes it; else what is
    there."""
    found, maker = nearby_file(missing), maker_of(missing)
    options = [f"run `{maker}`, which writes {Path(missing).parent}"] if maker else []
    if found:
        fixed = [found if p == missing else p for p in paths]
        given = setting(key, fixed[0] if len(fixed) == 1 else fixed) if key else f"`{found}`"
        # the script's own folder missing, running it is the fix; else the file there is the one
        # meant
        at = len(options) if maker and not Path(missing).parent.is_dir() else 0
        options.insert(
            at, f"set {given} (the file in {Path(found).parent} closest to the name given)"
        )
    if options:
        return ", or ".join(options)
    folder = next(
        (p for p in [Path(missing).parent, *Path(missing).parent.parents] if p.is_dir()), Path(".")
    )
    present = sorted(
        p.name for p in folder.iterdir() if p.suffix in (".jsonl", ".parquet", ".json")
    )
    return (
        f"set {key or 'the path'} to existing .parquet, .jsonl or .json files; the nearest "
        f"existing folder, {folder}, holds {present or 'none'}"
    )


def _load_file(path: Path) -> list[dict]:
    if not path.is_file():
        raise KeelError(DATA_FILE, f"dataset file {str(path)!r} does not exist or is not a file")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _load_parquet(path)
    if suffix in (".jsonl", ".json"):
        return _load_json(path)
    raise KeelError(
        DATA_FILE,
        f"dataset file {str(path)!r} has extension {suffix or '(none)'!r}; keel reads "
        ".parquet, .jsonl and .json",
    )


def _load_parquet(path: Path) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise KeelError(DATA_FILE, f"cannot read parquet file {str(path)!r}: {e}") from e
    # Nested columns (chat messages, reward_model structs) come back as python lists and dicts.
    return table.to_pylist()


def _load_json(path: Path) -> list[dict]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KeelError(DATA_FILE, f"cannot read {str(path)!r} as UTF-8 text: {e}") from e
    # A `.json` file may hold one JSON list of rows; anything else is read as JSON lines.
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise KeelError(
                DATA_FILE, f"{str(path)!r} line {e.lineno}: invalid JSON: {e.msg}"
            ) from e
        for i, row in enumerate(rows):
            _check_object(row, f"{str(path)!r} item {i}")
        return rows
    return _parse_json_lines(path, text)


def _parse_json_lines(path: Path, text: str) -> list[dict]:
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{str(path)!r} line {lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise KeelError(DATA_FILE, f"{where}: invalid JSON: {e.msg}") from e
        _check_object(row, where)
        rows.append(row)
    return rows


def _check_object(row: Any, where: str) -> None:
    if not isinstance(row, dict):
        raise KeelError(
            DATA_FILE, f"{where}: expected a JSON object (one row), got {type(row).__name__}"
        )


# --- records ----------------------------------------------------------------------------------


@dataclass
class PromptStats:
    total: int
    kept: int
    truncated: int
    dropped: int
    name: str = "train"

    def summary(self) -> str:
        return (
            f"{self.name} data: {self.total} prompts, {self.kept} kept, "
            f"{self.truncated} truncated, {self.dropped} dropped as overlong"
        )


def build_prompt_dataset(
    rows: list[dict],
    tokenizer,
    *,
    prompt_key: str = "prompt",
    max_prompt_length: int = 512,
    truncation: str = "error",
    filter_overlong_prompts: bool = False,
    apply_chat_template: bool = True,
    name: str = "train",
) -> tuple[list[PromptRecord], PromptStats]:
    """Template and tokenize every row; drop, truncate or reject prompts over the limit."""
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
    # an environment without this split (a tokenizer given no text at all raises)
    if not rows:
        return [], PromptStats(total=0, kept=0, truncated=0, dropped=0, name=name)
    prompts = [_get_prompt(row, i, prompt_key, name) for i, row in enumerate(rows)]
    texts = _render_prompts(prompts, tokenizer, apply_chat_template, name)
    # One batched call: the fast tokenizer encodes the whole dataset in Rust. The chat template
    # already placed its special tokens, so none are added again.
    all_ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]

    overlong = [i for i, ids in enumerate(all_ids) if len(ids) > max_prompt_length]
    if overlong and not filter_overlong_prompts and truncation == "error":
        raise _too_long_error(overlong, all_ids, max_prompt_length, name)

    skip = set(overlong) if filter_overlong_prompts else set()
    records = []
    for i, (row, text, ids) in enumerate(zip(rows, texts, all_ids)):
        if i in skip:
            continue
        if len(ids) > max_prompt_length:
            ids = _truncate(ids, max_prompt_length, truncation)
            text = tokenizer.decode(ids, skip_special_tokens=False)
        records.append(_make_record(i, row, ids, text, prompts[i]))

    stats = PromptStats(
        total=len(rows),
        kept=len(records),
        truncated=0 if filter_overlong_prompts else len(overlong),
        dropped=len(skip),
        name=name,
    )
    return records, stats


def _get_prompt(row: dict, i: int, prompt_key: str, name: str) -> str | list[dict]:
    prompt = row.get(prompt_key)
    if prompt is None:
        column = _prompt_column(row)
        raise KeelError(
            DATA_COLUMN,
            f"{name} data row {i} has no {prompt_key!r} column (or it is null); the row's "
            f"columns are {sorted(row)}",
            f"set {setting('data.prompt_key', column)} (the row's prompt-like column)"
            if column
            else None,
        )
    is_chat = (
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    )
    if not (isinstance(prompt, str) or is_chat):
        raise KeelError(
            DATA_COLUMN,
            f"{name} data row {i}: {prompt_key!r} must be a string or a non-empty list "
            f"of {{'role', 'content'}} messages, got {str(prompt)[:80]!r}",
            fix="Store each prompt as a string or as chat messages with 'role' and "
            "'content' keys, as verl's schema does.",
        )
    return prompt


PROMPT_NAMES = (
    "prompt",
    "question",
    "problem",
    "query",
    "instruction",
    "input",
    "messages",
    "text",
)


def _prompt_column(row: dict) -> str | None:
    """The column that holds the row's prompt: its only text or chat column, or one so named."""
    texts = [
        k
        for k, v in row.items()
        if isinstance(v, str)
        or (
            isinstance(v, list)
            and v
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in v)
        )
    ]
    named = [k for k in texts if k.lower() in PROMPT_NAMES]
    return texts[0] if len(texts) == 1 else named[0] if len(named) == 1 else None


def _render_prompts(
    prompts: list[str | list[dict]], tokenizer, apply_chat_template: bool, name: str
) -> list[str]:
    """The text the model sees for each prompt."""
    has_template = tokenizer.chat_template is not None
    if apply_chat_template and has_template:
        chats = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
        if not chats:
            return []
        # The generation prompt opens the assistant turn, so sampling starts with the answer.
        return tokenizer.apply_chat_template(chats, add_generation_prompt=True, tokenize=False)
    chat_rows = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if apply_chat_template and chat_rows:
        raise KeelError(
            NO_CHAT_TEMPLATE,
            f"{name} data row {chat_rows[0]} (and "
            f"{len(chat_rows) - 1} more) is a chat, but the "
            "tokenizer has no chat template",
            f"set {setting('data.apply_chat_template', False)} to join the messages' contents as "
            "plain text, or use a tokenizer with a chat template",
        )
    return [p if isinstance(p, str) else "\n".join(m["content"] for m in p) for p in prompts]


def _too_long_error(
    overlong: list[int], all_ids: list[list[int]], limit: int, name: str
) -> KeelError:
    first = overlong[0]
    longest = max(len(all_ids[i]) for i in overlong)
    # Say how many rows are affected, so the user can choose between filtering and a higher limit.
    return KeelError(
        PROMPT_TOO_LONG,
        f"{name} data row {first} is {len(all_ids[first])} tokens, over "
        f"data.max_prompt_length={limit}; {len(overlong)} of {len(all_ids)} prompts "
        f"are over the limit, the longest {longest} tokens",
        f"set {setting('data.max_prompt_length', longest)} (the longest prompt), or "
        f"{setting('data.filter_overlong_prompts', True)} to drop the {len(overlong)}, or "
        f"{setting('data.truncation', 'left')} to keep each prompt's end",
    )


def _truncate(ids: list[int], limit: int, truncation: str) -> list[int]:
    # `left` keeps the end, where the question and the generation prompt sit; `right` keeps the
    # start (system prompt) but may cut the assistant-turn opener the template appended.
    return ids[-limit:] if truncation == "left" else ids[:limit]


def _make_record(i: int, row: dict, ids: list[int], text: str, raw_prompt) -> PromptRecord:
    reward_model = row.get("reward_model")
    ground_truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    return PromptRecord(
        index=i,
        prompt_ids=ids,
        prompt_text=text,
        data_source=row.get("data_source") or "unknown",
        ground_truth=ground_truth,
        extra_info=row.get("extra_info") or {},
        raw_prompt=raw_prompt,
    )


# --- batching ---------------------------------------------------------------------------------


def collate_prompts(records: list[PromptRecord], pad_token_id: int) -> PromptBatch:
    """Left-pad to the longest prompt: generation appends on the right, so every prompt must end
    at the same column."""
    if not records:
        raise ValueError("collate_prompts needs at least one record")
    width = max(len(r.prompt_ids) for r in records)
    input_ids = torch.full((len(records), width), pad_token_id, dtype=torch.long)  # [B, P]
    attention_mask = torch.zeros((len(records), width), dtype=torch.long)  # [B, P]
    for row, record in enumerate(records):
        length = len(record.prompt_ids)
        if length:
            input_ids[row, width - length :] = torch.tensor(record.prompt_ids, dtype=torch.long)
            attention_mask[row, width - length :] = 1
    return PromptBatch(input_ids=input_ids, attention_mask=attention_mask, records=list(records))
