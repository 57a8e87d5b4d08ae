"""The errors a scored batch ends a run with: too many samples not scored, or one that
reward.on_error=raise stops at (a non-number, a timeout, a scorer that raised)."""

from __future__ import annotations

from keel.errors import (
    REWARD_NOT_NUMBER,
    SCORER_RAISED,
    SCORER_TIMEOUT,
    TOO_MANY_NOT_SCORED,
    KeelError,
)
from keel.errors.fixes import setting


def too_many_not_scored(
    failed: list[tuple[int, str]], records: list, max_ratio: float
) -> KeelError:
    return KeelError(
        TOO_MANY_NOT_SCORED,
        f"{len(failed)} of {len(records)} samples could not be scored "
        f"(over reward.max_not_scored_ratio={max_ratio}); first reason: "
        f"{failed[0][1]} (data_source={records[failed[0][0]].data_source!r})",
        "fix the scorer for the reason named; if such failures are expected, set "
        + setting("reward.max_not_scored_ratio", min(1.0, round(2 * len(failed) / len(records), 1)))
        + " (twice this batch's share)",
    )


def scoring_error(
    record, reason: str, response: str, timeout_s: float | None = None, code: str | None = None
) -> KeelError:
    """`code`: "`function` in `file`" of the user's scorer, where the fix is to be made."""
    where = f"data_source={record.data_source!r}, response {response[:60]!r}"
    if reason.startswith("not a number"):
        return KeelError(
            REWARD_NOT_NUMBER,
            f"the reward function returned {reason[len('not a number: ') :]} ({where})",
            f"make {code} return a finite float for every sample (e.g. return float(score))"
            if code
            else None,
        )
    if reason.startswith("timeout"):
        return KeelError(
            SCORER_TIMEOUT,
            f"scoring took longer than reward.timeout_s={timeout_s} ({where})",
            f"set {setting('reward.timeout_s', 10 * timeout_s)} if the scorer is just slow, "
            "or make it faster"
            if timeout_s
            else None,
        )
    return KeelError(
        SCORER_RAISED,
        f"the scorer {reason} ({where})",
        f"make {code} score this input without raising (an empty response must score, e.g. 0.0)"
        if code
        else None,
    )
