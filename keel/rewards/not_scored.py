"""What a sample that could not be scored becomes, and when too many of them stop the run."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from keel.errors import SkipStep
from keel.rewards.score_errors import scoring_error, too_many_not_scored
from keel.rewards.worker import NOT_FINITE, SampleResult

log = logging.getLogger("keel")


@dataclass(frozen=True)
class NotScoredPolicy:
    """`on_error`: `mask` (left out of the update), `zero` (scored 0) or `raise` (the run stops).
    With mask or zero, a share of not-scored samples above `max_ratio` stops the run: a scorer
    failing that often is broken, not unlucky. `nonfinite` (trainer.guards.nonfinite): `skip` drops
    a training step that NaN or infinite scores pushed over the share, `stop` stops it."""

    on_error: str = "mask"
    max_ratio: float = 0.1
    nonfinite: str = "stop"

    def failures(
        self,
        results: list[SampleResult],
        records: list,
        texts: list[str],
        on_error: str,
        timeout_s: float | None,
        user_code: Callable[[str], str | None],
    ) -> list[tuple[int, str]]:
        """The samples not scored, as (index, reason), logged. With on_error=raise the first one
        stops the run, its error naming the user's code (`user_code` of its data_source)."""
        failed = [(i, res.reason) for i, res in enumerate(results) if res.values is None]
        if failed:
            log.warning(
                "%d of %d samples not scored (first: %s); reward.on_error=%s",
                len(failed),
                len(records),
                failed[0][1],
                on_error,
            )
        if failed and on_error == "raise":
            first = records[failed[0][0]]
            raise scoring_error(
                first,
                failed[0][1],
                texts[failed[0][0]],
                timeout_s,
                user_code(first.data_source),
            )
        return failed

    def check_share(self, failed: list[tuple[int, str]], records: list, may_skip: bool) -> None:
        """Past `max_ratio` not scored: the step skipped (SkipStep) where `skip_if_nonfinite` says
        so, else KEEL-R006. `may_skip`: a training step, which may be dropped."""
        if len(failed) / max(len(records), 1) > self.max_ratio:
            self.skip_if_nonfinite(failed, len(records), may_skip)
            raise too_many_not_scored(failed, records, self.max_ratio)

    def skip_if_nonfinite(self, failed: list[tuple[int, str]], total: int, may_skip: bool) -> None:
        """trainer.guards.nonfinite=skip: a batch pushed over max_not_scored_ratio by NaN or
        infinite scores is skipped like a step with NaN log-probs. Other failures past the ratio
        still stop."""
        nonfinite = [
            reason for _, reason in failed if reason.removeprefix("service: ") in NOT_FINITE
        ]
        if not (may_skip and self.nonfinite == "skip" and nonfinite):
            return
        if (len(failed) - len(nonfinite)) / total <= self.max_ratio:
            log.warning(
                "skipping the step: %d of %d scores are NaN or infinite", len(nonfinite), total
            )
            raise SkipStep("rewards")
