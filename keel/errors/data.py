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

EMPTY_COMPLETION = register(
    "KEEL-D007",
    "Preference pair with an empty completion",
    "A row's chosen or rejected completion is empty (no text, or chat messages with no assistant "
    "content): the pair's log-prob or score would compare nothing.",
    "Remove the row or fill its completion; the message names the row and the column.",
    ("data.chosen_key", "data.rejected_key"),
)
IDENTICAL_PAIR = register(
    "KEEL-D008",
    "Preference pair whose chosen and rejected are the same",
    "Chosen and rejected tokenize to the same tokens, so the pair has no preference to learn: "
    "DPO's loss is constant on it and a reward model's pushes nowhere. Such rows are dropped "
    "with this warning; when every row is, the run stops.",
    "Remove the rows (the message names the first ones), or check that data.chosen_key and "
    "data.rejected_key name two different columns.",
    ("data.chosen_key", "data.rejected_key"),
)
PAIR_TOO_LONG = register(
    "KEEL-D009",
    "Preference pair longer than data.max_length",
    "A completion with its prompt is over data.max_length tokens and cannot be cut to fit: "
    "`data.truncation=error`, or the completion alone (with the prompt's last token) is over the "
    "limit. Completions are never cut: the tokens a preference is about may be the last ones.",
    "Set `data.max_length` to the longest pair (the fix line gives it), or "
    "`data.truncation=left` to cut long prompts from their start.",
    ("data.max_length", "data.truncation"),
)

RESPONSE_COLUMN = register(
    "KEEL-D010",
    "Prompt row without the response GKD's off-policy steps train on",
    "With distillation.mode=gkd and distillation.gkd.lmbda < 1, a share of the steps trains on "
    "each prompt row's own response (the `distillation.response_key` column, default "
    "`response`): a string, the completion of the prompt. A row lacks it, or holds no string "
    "there.",
    "Add the column to every training row, point `distillation.response_key` at the column that "
    "holds the completions (the fix line names the row's text column), or set "
    "`distillation.gkd.lmbda=1` to train on the student's samples alone.",
    ("distillation.response_key", "distillation.gkd.lmbda"),
)

__all__ = [name for name in dir() if name.isupper()]
