"""Preference data: rows of a prompt and two completions, chosen and rejected, tokenized as pairs.

TRL's formats are read as they are: strings (prompt tokens, then the completion's and EOS, no
template), chat messages (rendered with the tokenizer's chat template, the completion being what
the assistant turn adds), and chosen/rejected as whole conversations with no prompt column (the
prompt is their shared leading messages). A reward model's pairs are rendered the way keel's
reward model reads a sample when it scores (`keel.models.chat.conversation_text`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from keel.errors import (
    DATA_COLUMN,
    DATA_EMPTY,
    EMPTY_COMPLETION,
    IDENTICAL_PAIR,
    NO_CHAT_TEMPLATE,
    PAIR_TOO_LONG,
    KeelError,
)
from keel.errors.fixes import setting
from keel.models.chat import as_messages, conversation_text

log = logging.getLogger("keel")


@dataclass(frozen=True, slots=True)
class PreferencePair:
    # the shared prompt, then each completion's tokens (what a DPO log-prob sums over)
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    # reward_model: how much better chosen is (the data's margin column), else None
    margin: float | None = None

    @property
    def chosen_targets(self) -> int:
        """Chosen tokens a log-prob is read for: with no prompt the first has nothing before it."""
        return len(self.chosen_ids) - (not self.prompt_ids)


@dataclass(frozen=True)
class PairStats:
    name: str
    total: int
    # prompts cut from their start to fit data.max_length
    truncated: int
    # rows dropped: chosen and rejected the same tokens
    identical: int

    def summary(self) -> str:
        return (
            f"{self.name} preference data: {self.total} pairs, {self.truncated} prompts cut to "
            f"fit data.max_length, {self.identical} identical pairs dropped"
        )


@dataclass(frozen=True)
class PairColumns:
    prompt: str
    chosen: str
    rejected: str
    margin: str
    # the margin column was named by the user (data.margin_key), so the data must have it
    margin_named: bool = False

    @classmethod
    def of(cls, data_cfg) -> PairColumns:
        """The columns a config's `data` section names."""
        d = data_cfg
        named = d.margin_key != type(d).margin_key
        return cls(d.prompt_key, d.chosen_key, d.rejected_key, d.margin_key, named)


def build_pairs(
    rows: list[dict],
    tokenizer,
    columns: PairColumns,
    *,
    max_length: int,
    truncation: str,
    for_reward_model: bool,
    name: str = "train",
    files: list[str] | tuple[str, ...] = (),
) -> tuple[list[PreferencePair], PairStats]:
    """Every row as a tokenized pair that fits max_length; identical pairs dropped (KEEL-D008)."""
    tokenize = _reward_model_pair if for_reward_model else _dpo_pair
    pairs, identical, moved = [], [], []
    for i, row in enumerate(rows):
        prompt, chosen, rejected = _row_parts(row, columns, i, name, _files_text(name, files))
        pair, split_moved = tokenize(tokenizer, prompt, chosen, rejected)
        if split_moved:
            moved.append(i)
        if for_reward_model and row.get(columns.margin) is not None:
            pair = replace(pair, margin=_margin(row[columns.margin], columns.margin, i, name))
        if pair.chosen_ids == pair.rejected_ids:
            identical.append(i)
        else:
            pairs.append(pair)
    if for_reward_model and columns.margin_named and not any(columns.margin in r for r in rows):
        raise KeelError(
            DATA_COLUMN,
            f"data.margin_key={columns.margin!r} names no column of the {name} preference rows; "
            f"their columns are {sorted(rows[0])}",
            "set data.margin_key to the margin's column, or leave it unset (no margins)",
        )
    _refuse_or_warn_identical(identical, len(rows), name, _files_text(name, files))
    if moved:
        log.warning(
            "%s preference data: in %d rows (first %s) the chat template opens the assistant "
            "turn with tokens the whole conversation does not have (a thought block?); their "
            "completions start where the two renderings part, as TRL's do",
            name,
            len(moved),
            moved[:5],
        )
    pairs, truncated = fit_to_length(pairs, max_length, truncation, name)
    return pairs, PairStats(name, len(pairs), truncated, len(identical))


def _files_text(name: str, files) -> str:
    """Where a split's rows are, as a fix line names it: the file itself when there is one."""
    return f"`{files[0]}`" if len(files) == 1 else f"the {name} files"


def _row_parts(row: dict, columns: PairColumns, i: int, name: str, where: str) -> tuple:
    """(prompt, chosen, rejected) of a row; the prompt of whole conversations is their shared
    leading messages (TRL's implicit-prompt format)."""
    missing = [c for c in (columns.chosen, columns.rejected) if c not in row]
    if missing:
        raise KeelError(
            DATA_COLUMN,
            f"{name} preference row {i} has no {missing[0]!r} column; its columns are "
            f"{sorted(row)}",
            "set data.prompt_key, data.chosen_key and data.rejected_key to the columns of the "
            "prompt and the two completions",
        )
    chosen, rejected = row[columns.chosen], row[columns.rejected]
    if columns.prompt in row:
        prompt = row[columns.prompt]
    elif isinstance(chosen, list) and isinstance(rejected, list):
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    else:
        raise KeelError(
            DATA_COLUMN,
            f"{name} preference row {i} has no {columns.prompt!r} column, and its completions "
            f"are not whole conversations to find it in; its columns are {sorted(row)}",
            "set data.prompt_key to the prompt's column",
        )
    _check_forms(columns, (prompt, chosen, rejected), i, name, where)
    return prompt, chosen, rejected


def _check_forms(columns: PairColumns, values: tuple, i: int, name: str, where: str) -> None:
    """Each part text or a chat; a missing completion is an empty one (EMPTY_COMPLETION)."""
    prompt, chosen, rejected = values
    for column, value in (
        (columns.prompt, prompt),
        (columns.chosen, chosen),
        (columns.rejected, rejected),
    ):
        if not _text_or_chat(value) and not (value is None and column != columns.prompt):
            raise KeelError(
                DATA_COLUMN,
                f"{name} preference row {i}: its {column!r} is {type(value).__name__}, neither "
                "a string nor chat messages (a list of role/content dicts)",
                f"remove row {i} from {where}, or write its {column} as a string",
            )
    for column, completion in ((columns.chosen, chosen), (columns.rejected, rejected)):
        if completion is None or not _completion_text(completion).strip():
            raise KeelError(
                EMPTY_COMPLETION,
                f"{name} preference row {i}: its {column!r} completion is empty",
                f"remove row {i} from {where}, or give it a {column} completion",
            )


def _text_or_chat(value) -> bool:
    if isinstance(value, str):
        return True
    return isinstance(value, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value
    )


def _margin(value, column: str, i: int, name: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise KeelError(
            DATA_COLUMN,
            f"{name} preference row {i}: its margin {value!r} (column {column!r}) is not a number",
            "give every row a numeric margin (how much better chosen is), or none",
        ) from None


def _completion_text(completion) -> str:
    """A completion's text: a string, or its assistant messages' contents joined."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") for m in completion if m.get("role") == "assistant")


def _dpo_pair(tokenizer, prompt, chosen, rejected) -> tuple[PreferencePair, bool]:
    """The pair, and whether the chat template's opened assistant turn differs from the turn in
    the whole conversation (the completion then starts where the two part)."""
    if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
        # TRL's standard format: no template, the prompt with the tokenizer's own special tokens
        # (a Llama BOS), each completion ended by EOS
        prompt_ids = tokenizer(prompt)["input_ids"]
        ids = [
            tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            for c in (chosen, rejected)
        ]
        return PreferencePair(prompt_ids, *ids), False
    messages = as_messages(prompt)
    prompt_ids = _chat_ids(tokenizer, messages, open_assistant=True)
    wholes = []
    for completion in (chosen, rejected):
        turns = as_messages(completion) if not isinstance(completion, str) else None
        turns = turns or [{"role": "assistant", "content": completion}]
        wholes.append(_chat_ids(tokenizer, messages + turns, open_assistant=False))
    # TRL's split: the completion is what the conversation adds past the opened assistant turn, or
    # past where the two part (a template may open the turn alone with tokens, such as an empty
    # thought block, that the whole conversation does not have)
    shared = min(_common_prefix(prompt_ids, whole) for whole in wholes)
    pair = PreferencePair(wholes[0][:shared], *(whole[shared:] for whole in wholes))
    return pair, shared < len(prompt_ids)


def _common_prefix(ids: list[int], other: list[int]) -> int:
    return next(
        (i for i, (a, b) in enumerate(zip(ids, other)) if a != b), min(len(ids), len(other))
    )


def _chat_ids(tokenizer, messages: list[dict], open_assistant: bool) -> list[int]:
    if tokenizer.chat_template is None:
        raise KeelError(
            NO_CHAT_TEMPLATE,
            "preference data holds chat messages, but the tokenizer has no chat template",
        )
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=open_assistant
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _reward_model_pair(tokenizer, prompt, chosen, rejected) -> tuple[PreferencePair, bool]:
    """Each completion rendered with its prompt as the reward model reads it when scoring; the
    prompt is the two texts' shared leading tokens (what truncation may cut)."""
    whole = [
        tokenizer(
            conversation_text(tokenizer, prompt, _completion_text(c)), add_special_tokens=False
        )["input_ids"]
        for c in (chosen, rejected)
    ]
    shared = 0
    while shared < min(map(len, whole)) - 1 and whole[0][shared] == whole[1][shared]:
        shared += 1
    return PreferencePair(whole[0][:shared], whole[0][shared:], whole[1][shared:]), False


def _refuse_or_warn_identical(identical: list[int], total: int, name: str, where: str) -> None:
    if not identical:
        return
    message = (
        f"{len(identical)} of {total} {name} preference rows have the same chosen and rejected "
        f"tokens (rows {identical[:5]}{' ...' if len(identical) > 5 else ''})"
    )
    fix = f"remove those rows from {where}, or check data.chosen_key and data.rejected_key"
    if len(identical) == total:
        raise KeelError(IDENTICAL_PAIR, message + ": nothing is left to learn from", fix)
    log.warning("warning[%s]: %s; they are dropped\n  fix: %s", IDENTICAL_PAIR, message, fix)


def fit_to_length(
    pairs: list[PreferencePair], max_length: int, truncation: str, name: str
) -> tuple[list[PreferencePair], int]:
    """Pairs over max_length with their prompts cut from the start (truncation=left), keeping at
    least the prompt's last token; completions are never cut (PAIR_TOO_LONG)."""
    if not pairs:
        raise KeelError(DATA_EMPTY, f"the {name} preference files hold no rows")
    lengths = [len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) for p in pairs]
    over = [i for i, n in enumerate(lengths) if n > max_length]
    if not over:
        return pairs, 0
    longest = max(lengths)
    uncuttable = [
        i
        for i in over
        if truncation == "error" or lengths[i] - len(pairs[i].prompt_ids) + 1 > max_length
    ]
    if uncuttable:
        i = uncuttable[0]
        raise KeelError(
            PAIR_TOO_LONG,
            f"{name} preference row {i} is {lengths[i]} tokens (prompt and its longer "
            f"completion), over data.max_length={max_length}; {len(over)} of {len(pairs)} pairs "
            f"are over, the longest {longest} tokens"
            + ("" if truncation == "error" else ", and this one's completion alone does not fit"),
            f"set {setting('data.max_length', longest)} (the longest pair)"
            + (f", or {setting('data.truncation', 'left')}" if truncation == "error" else ""),
        )
    fitted = list(pairs)
    for i in over:
        keep = max_length - (lengths[i] - len(pairs[i].prompt_ids))
        pair = pairs[i]
        fitted[i] = PreferencePair(
            pair.prompt_ids[-keep:], pair.chosen_ids, pair.rejected_ids, pair.margin
        )
    log.warning(
        "%s preference data: %d of %d prompts cut from their start to fit data.max_length=%d "
        "(the longest pair is %d tokens; set data.max_length=%d to keep them whole)",
        name,
        len(over),
        len(pairs),
        max_length,
        longest,
        longest,
    )
    return fitted, len(over)
