"""Error codes KEEL-D: data."""

from keel.errors.base import register

DATA_FILE = register(
    "KEEL-D001",
    "Dataset file missing or unreadable",
    "A path in `data.train_files` / `data.val_files` does not exist or is not parquet or JSONL.",
    "Set `data.train_files` / `data.val_files` to existing `.parquet`, `.jsonl` or `.json` files: "
    "the fix line names the file beside the missing one spelt most like it, or the script that "
    "writes it (`python examples/quickstart/prepare.py` for examples/data).",
    ("data.train_files", "data.val_files"),
)
DATA_COLUMN = register(
    "KEEL-D002",
    "Dataset is missing a required column",
    "Every row needs the prompt column (`data.prompt_key`, default `prompt`).",
    "Point `data.prompt_key` at the column that holds prompts (the fix line names the row's "
    "prompt-like column), or add the column.",
    ("data.prompt_key",),
)
PROMPT_TOO_LONG = register(
    "KEEL-D003",
    "Prompt longer than data.max_prompt_length",
    "With `data.truncation=error`, a prompt over the limit stops the run rather than being "
    "cut silently.",
    "Set `data.max_prompt_length` to the longest prompt (the fix line gives it), "
    "`data.filter_overlong_prompts=true` to drop the overlong ones, or `data.truncation=left` to "
    "keep each prompt's end.",
    ("data.max_prompt_length", "data.truncation", "data.filter_overlong_prompts"),
)
DATA_EMPTY = register(
    "KEEL-D004",
    "Dataset empty or smaller than one batch",
    "The dataset files hold no rows at all, or after filtering the dataset has fewer prompts "
    "than `data.train_batch_size`, so not one step could run.",
    "Lower `data.train_batch_size` to the prompts there are, in whole mini-batches (the fix line "
    "gives it), add data, or relax the overlong-prompt filter.",
    ("data.train_batch_size", "data.filter_overlong_prompts"),
)
SFT_TOO_LONG = register(
    "KEEL-D005",
    "SFT example longer than data.max_length",
    "With `data.truncation=error`, an example over the limit stops the run rather than being cut "
    "silently (a cut example may lose the very answer it should teach).",
    "Set `data.max_length` to the longest example (the fix line gives it), or "
    "`data.truncation=right` (keep the start) or `left`.",
    ("data.max_length", "data.truncation"),
)
NO_ASSISTANT_TURN = register(
    "KEEL-D006",
    "SFT example has nothing to learn from",
    "SFT trains only on assistant tokens; this conversation has no assistant message with content, "
    "so its loss would be empty.",
    "Give every example an assistant turn (`messages` with role `assistant`, or a response "
    "column).",
    ("data.messages_key", "data.response_key"),
)

__all__ = [name for name in dir() if name.isupper()]
