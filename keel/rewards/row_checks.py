"""Before any generation: every row can be scored, so none scores 0 forever or fails mid-run."""

from __future__ import annotations

from keel.errors import MISSING_GROUND_TRUTH, KeelError
from keel.rewards.choice import ScorerChoice
from keel.rewards.jail.sandbox import require_jail
from keel.rewards.verl.code_tests import check_ground_truths


def check_rows(
    choice: ScorerChoice, records: list, files: list[str] = (), sandbox_require: str = "isolation"
) -> None:
    """Fail if some row could not be scored: no scorer for its data_source, no ground truth for a
    built-in scorer (which would score it 0 forever), or code test cases in neither form; rows
    scored by running the response need the jail `sandbox_require` names. `files`: the data files
    the records come from, for the fix line."""
    needs_truth = {
        s for s in sorted({r.data_source for r in records}) if choice.needs_ground_truth(s)
    }
    missing = [r.index for r in records if r.data_source in needs_truth and r.ground_truth is None]
    if missing:
        sources = sorted(needs_truth & {r.data_source for r in records if r.ground_truth is None})
        raise KeelError(
            MISSING_GROUND_TRUTH,
            f"{len(missing)} rows (first: row {missing[0]}) have no "
            "reward_model.ground_truth, which the built-in scorers compare against",
            'add "reward_model": {"ground_truth": ...} (each row\'s right answer) '
            f"to the rows of data_source {sources}{_in_files(files)}, or score them with your own "
            "custom_reward_function",
        )
    code_rows = [r for r in records if choice.runs_code(r.data_source)]
    if code_rows:
        # every row: test cases in neither form would never score
        try:
            check_ground_truths(code_rows)
        except KeelError as refused:
            where = f"{_in_files(files).strip()}: " if files else ""
            raise KeelError(refused.code, refused.message, where + refused.fix) from None
        require_jail(sandbox_require)


def _in_files(files: list[str]) -> str:
    """ " in `a.jsonl` or `b.jsonl`": where the rows a fix names are."""
    return "".join(f" in `{f}`" for f in files[:1]) + "".join(f" or `{f}`" for f in files[1:])
