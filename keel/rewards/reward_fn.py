"""Turn responses into scores: pick a scorer per data_source, call it, refuse bad results."""

from __future__ import annotations

import inspect
import logging
import pickle
from dataclasses import dataclass, field

import torch

from keel.errors import (
    MISSING_GROUND_TRUTH,
    NO_SCORER,
    KeelError,
    SkipStep,
)
from keel.errors.fixes import setting
from keel.rewards.code_tests import check_ground_truths
from keel.rewards.contract import AGENT_WEIGHTS, agent_reward, verl_extra_info
from keel.rewards.executor import ScoringPool, Started
from keel.rewards.sandbox import require_jail
from keel.rewards.score_errors import scoring_error, too_many_not_scored
from keel.rewards.score_metrics import score_metrics
from keel.rewards.scorers import (
    DATA_SOURCE_SCORERS,
    NO_GROUND_TRUTH,
    SCORERS,
    RewardFn,
    scorer_for_source,
)
from keel.rewards.worker import (
    NOT_FINITE,
    SampleResult,
    SampleTask,
    Spec,
    resolve,
    score_batched,
)

log = logging.getLogger("keel")


# scorers that run the response
RUN_CODE = (("builtin", "code_exec"), ("builtin", "prime_code"))
# the spec naming the reward model in a data_source's scorers
REWARD_MODEL = ("reward_model",)
SERVICE = ("service",)


@dataclass
class ScoreResult:
    scores: torch.Tensor  # [N]; 0 where not scored
    scored: torch.Tensor  # [N] bool
    reasons: list[str | None]  # [N] why a sample was not scored
    metrics: dict[str, float]
    # [N] dict results' other keys (verl's reward_extra_info)
    extras: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class StartedSample:
    """A sample's scoring begun ahead of its batch (`RewardScorer.start`)."""

    # what it scores, pickled: the response, its row's ground truth and extra_info, the scorers
    task: bytes
    started: Started

    def of(self, task: SampleTask) -> Started | None:
        """The scoring begun, if it is `task`'s (a sample whose text or record differs is scored again).
        Compared pickled: a record's numpy arrays (verl's parquet rows) compare elementwise otherwise."""
        return self.started if pickle.dumps(task) == self.task else None


class RewardScorer:
    """Scores a batch of responses; every sample is scored or marked not scored with a reason.

    Per data_source: the weighted scorers named in `reward.scorers`, else the custom function (it
    serves every data_source, as in verl), else the built-in scorer for that data_source. The name
    `custom` in `reward.scorers` refers to the custom function, so it can be combined with rules.

    `on_error` decides what a not-scored sample becomes: `mask` (left out of the update), `zero`
    (scored 0) or `raise` (the run stops). With mask or zero, a share of not-scored samples above
    `max_not_scored_ratio` stops the run: a scorer failing that often is broken, not unlucky.
    """

    def __init__(
        self,
        custom: RewardFn | tuple | None = None,
        by_source: dict[str, dict[str, float]] | None = None,
        overlong=None,
        max_response_length: int | None = None,
        on_error: str = "mask",
        max_not_scored_ratio: float = 0.1,
        timeout_s: float | None = None,
        num_workers: int = 0,
        batched: bool = False,
        reward_model=None,
        service=None,
        sandbox_require: str = "isolation",
        nonfinite: str = "stop",
    ):
        self.service = service
        self.nonfinite = nonfinite
        self.sandbox_require = sandbox_require
        self.custom = custom
        self.batched = batched
        self.reward_model = reward_model
        self.by_source = by_source or {}
        self.overlong = overlong if overlong is not None and overlong.enable else None
        self.max_response_length = max_response_length
        self.on_error = on_error
        self.max_not_scored_ratio = max_not_scored_ratio
        self.timeout_s = timeout_s
        self.pool = ScoringPool(num_workers)
        _check_scorer_names(self.by_source, bool(custom), bool(reward_model))

    def scorers_for(self, data_source: str) -> dict[str, tuple[Spec, float]]:
        """{name: (scorer spec, weight)} for one data_source."""
        if self.service is not None:
            return {"service": (SERVICE, 1.0)}
        if data_source in self.by_source:
            named = {"custom": self.custom, "reward_model": REWARD_MODEL}
            return {
                name: (named.get(name, ("builtin", name)), weight)
                for name, weight in self.by_source[data_source].items()
            }
        if self.reward_model is not None:
            return {"reward_model": (REWARD_MODEL, 1.0)}
        if self.custom is not None:
            return {"custom": (self.custom, 1.0)}
        name = scorer_for_source(data_source)
        if name is None:
            raise KeelError(
                NO_SCORER,
                f"no scorer for data_source={data_source!r}; built-in ones serve {sorted(DATA_SOURCE_SCORERS)} and "
                "every data_source starting with 'aime' (verl's routing)",
                f"set {setting(f'reward.scorers.{data_source}.exact_match', 1.0)} (1 when the response is the row's "
                "ground truth, else 0), or set custom_reward_function.path to a file with compute_score(data_source, "
                "solution_str, ground_truth, extra_info)",
            )
        return {name: (("builtin", name), 1.0)}

    def describe(self, data_source: str) -> str:
        """Who scores `data_source`, in words, for `keel check`: verl users see which rule replaces
        their default_compute_score."""

        def one(name: str) -> str:
            if name == "service":
                return f"the reward service at {self.service.url}"
            if name == "reward_model":
                return "the reward model"
            if name == "custom":
                return f"your function {self.user_code(data_source) or ''}".rstrip()
            chosen = (
                ""
                if data_source in self.by_source
                else " (chosen by data_source, as verl's default_compute_score)"
            )
            return f"built-in `{name}`{chosen}"

        parts = self.scorers_for(data_source)
        if len(parts) == 1:
            return one(next(iter(parts)))
        return " + ".join(f"{weight} x {one(name)}" for name, (_, weight) in parts.items())

    def user_code(self, data_source: str) -> str | None:
        """ "`function` in `file`" of the custom function that scores `data_source`, when one does."""
        spec = self.scorers_for(data_source).get("custom", (None,))[0]
        if isinstance(spec, tuple):
            return f"`{spec[2]}` in `{spec[1]}`" if spec[:1] == ("file",) else None
        # a functools.partial when reward_kwargs are bound
        function = getattr(spec, "func", spec)
        try:
            return f"`{function.__name__}` in `{inspect.getsourcefile(function)}`"
        except (TypeError, AttributeError):
            return None

    def check_records(self, records: list, files: list[str] = ()) -> None:
        """Fail before any generation if some row could not be scored: no scorer for its
        data_source, or no ground truth for a built-in scorer (which would score it 0 forever).
        `files`: the data files the records come from, for the fix line."""
        needs_truth = set()
        for source in sorted({r.data_source for r in records}):
            if any(
                name in SCORERS and name not in NO_GROUND_TRUTH for name in self.scorers_for(source)
            ):
                needs_truth.add(source)
        missing = [
            r.index for r in records if r.data_source in needs_truth and r.ground_truth is None
        ]
        if missing:
            sources = sorted(
                needs_truth & {r.data_source for r in records if r.ground_truth is None}
            )
            raise KeelError(
                MISSING_GROUND_TRUTH,
                f"{len(missing)} rows (first: row {missing[0]}) have no "
                "reward_model.ground_truth, which the built-in scorers compare against",
                f'add "reward_model": {{"ground_truth": ...}} (each row\'s right answer) to the rows of '
                f"data_source {sources}{_in_files(files)}, or score them with your own "
                "custom_reward_function",
            )
        code_rows = [r for r in records if self._runs_code(r.data_source)]
        if code_rows:
            # every row: test cases in neither form would never score
            try:
                check_ground_truths(code_rows)
            except KeelError as refused:
                where = f"{_in_files(files).strip()}: " if files else ""
                raise KeelError(refused.code, refused.message, where + refused.fix) from None
            require_jail(self.sandbox_require)

    def runs_model_code(self, records: list) -> bool:
        """Whether some row is scored by running the response (code_exec, in keel's sandbox)."""
        return any(self._runs_code(source) for source in {r.data_source for r in records})

    def _runs_code(self, data_source: str) -> bool:
        return any(spec in RUN_CODE for spec, _ in self.scorers_for(data_source).values())

    # -> [N]
    def score(self, records: list, response_texts: list[str]) -> torch.Tensor:
        return self.score_batch(records, response_texts).scores

    @property
    def can_start(self) -> bool:
        """Whether `start` can begin samples ahead of their batch (scoring processes, scored one by one)."""
        return self.pool.num_workers > 0 and self.service is None and not self.batched

    def start(self, record, response_text: str) -> StartedSample | None:
        """One sample's scoring begun now, in the scoring processes, while the caller goes on (a
        sample that finished while others still generate); `score_batch(..., started=...)` reads
        it. None where it can only be scored with its batch: a reward service or batched function
        (one call for the batch), scoring in this process (reward.num_workers=0), or a reward the
        agent gave."""
        if self.service is not None or self.batched or agent_reward(record) is not None:
            return None
        task = sample_task(
            record, self.scorers_for(record.data_source), response_text, self.timeout_s
        )
        started = self.pool.start(task)
        return None if started is None else StartedSample(pickle.dumps(task), started)

    def score_batch(
        self,
        records: list,
        response_texts: list[str],
        response_lengths: torch.Tensor | None = None,
        on_error: str | None = None,
        may_skip: bool = True,
        started: list[StartedSample | None] | None = None,
    ) -> ScoreResult:
        """Scores, which samples were scored, and metrics: the per-scorer breakdown, not-scored
        counts by reason, scoring latency and the overlong penalty. `may_skip`: a training step,
        which trainer.guards.nonfinite=skip may drop (SkipStep) when NaN scores fill the batch.
        `started[i]`: sample i's scoring as `start` began it (if None, or another task's: scored now)."""
        on_error = on_error or self.on_error
        given = [agent_reward(r) for r in records]
        weights = [
            AGENT_WEIGHTS if g is not None else self.scorers_for(r.data_source)
            for r, g in zip(records, given)
        ]
        # what the agent left to the scorers
        rest = [i for i, g in enumerate(given) if g is None]
        tasks = [
            sample_task(records[i], weights[i], response_texts[i], self.timeout_s) for i in rest
        ]
        ahead = [_begun(started[i], task) for i, task in zip(rest, tasks)] if started else None
        scored_rest = iter(
            self._run(
                [records[i] for i in rest],
                [response_texts[i] for i in rest],
                [weights[i] for i in rest],
                ahead,
            )
            if rest
            else []
        )
        results = [
            SampleResult({"agent": g}, None, 0.0) if g is not None else next(scored_rest)
            for g in given
        ]
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
                response_texts[failed[0][0]],
                self.timeout_s,
                self.user_code(first.data_source),
            )
        totals = [
            sum(weight * res.values[name] for name, (_, weight) in w.items()) if res.values else 0.0
            for res, w in zip(results, weights)
        ]
        scores = torch.tensor(totals, dtype=torch.float32)
        scored = torch.tensor([res.values is not None or on_error == "zero" for res in results])
        metrics = score_metrics(results, failed)
        # how much of the batch began scoring as it finished, beside generation
        if ahead is not None:
            metrics["reward/scored_ahead"] = sum(a is not None for a in ahead) / max(
                len(records), 1
            )
        if self.service is not None:
            metrics["reward/service_retries"] = float(self.service.retries)
        if self.overlong is not None and response_lengths is not None:
            penalty = overlong_penalty(response_lengths, self.max_response_length, self.overlong)
            scores = scores + penalty * scored
            metrics["reward/overlong_penalty/mean"] = penalty.mean().item()
        if len(failed) / max(len(records), 1) > self.max_not_scored_ratio:
            self._skip_if_nonfinite(failed, len(records), may_skip)
            raise too_many_not_scored(failed, records, self.max_not_scored_ratio)
        return ScoreResult(
            scores,
            scored,
            [res.reason for res in results],
            metrics,
            [res.extras or {} for res in results],
        )

    def _skip_if_nonfinite(self, failed: list[tuple[int, str]], total: int, may_skip: bool) -> None:
        """trainer.guards.nonfinite=skip: a batch pushed over max_not_scored_ratio by NaN or infinite
        scores is skipped like a step with NaN log-probs. Other failures past the ratio still stop."""
        nonfinite = [
            reason for _, reason in failed if reason.removeprefix("service: ") in NOT_FINITE
        ]
        if not (may_skip and self.nonfinite == "skip" and nonfinite):
            return
        if (len(failed) - len(nonfinite)) / total <= self.max_not_scored_ratio:
            log.warning(
                "skipping the step: %d of %d scores are NaN or infinite", len(nonfinite), total
            )
            raise SkipStep("rewards")

    def _run(
        self, records: list, texts: list[str], weights: list[dict], started: list
    ) -> list[SampleResult]:
        """Each sample's per-scorer values, or the reason it has none (`started`: what the pool began)."""
        # reward.service.url: the remote service scores every sample
        if self.service is not None:
            return self.service.score(records, texts)
        tasks = [
            sample_task(r, w, text, self.timeout_s) for r, w, text in zip(records, weights, texts)
        ]
        # custom_reward_function.batched: the custom function scores the whole batch
        if self.batched:
            results = score_batched(resolve(self.custom), tasks)
        else:
            results = self.pool.run(tasks, self.timeout_s, started)
        add_reward_model_scores(self.reward_model, records, texts, weights, results)
        return results

    def close(self) -> None:
        """Stops the scoring processes; the next batch starts them again."""
        self.pool.close()

    def shutdown(self) -> None:
        """For good, at the end of a run: the scoring processes and a reward model pool's replicas."""
        self.pool.shutdown()
        if hasattr(self.reward_model, "shutdown"):
            self.reward_model.shutdown()


def _begun(started: StartedSample | None, task: SampleTask) -> Started | None:
    return started and started.of(task)


def sample_task(record, weights: dict, text: str, timeout_s: float | None) -> SampleTask:
    """What a scoring process runs for one sample: its rule scorers (the reward model runs here)."""
    return SampleTask(
        [(name, spec) for name, (spec, _) in weights.items() if spec != REWARD_MODEL],
        record.data_source,
        text,
        record.ground_truth,
        verl_extra_info(record.extra_info),
        timeout_s,
    )


def add_reward_model_scores(
    reward_model, records, texts, weights, results: list[SampleResult]
) -> None:
    """The reward model scores its samples in batches on the device, beside the rule scorers."""
    rows = [
        i for i, w in enumerate(weights) if "reward_model" in w and results[i].values is not None
    ]
    if not rows:
        return
    for i, value in zip(
        rows, reward_model.score([records[i].raw_prompt for i in rows], [texts[i] for i in rows])
    ):
        # too long to read whole: not scored, never truncated
        if isinstance(value, str):
            results[i] = SampleResult(None, value, results[i].seconds)
        else:
            results[i].values["reward_model"] = value


def _check_scorer_names(
    by_source: dict[str, dict[str, float]], custom: bool, reward_model: bool
) -> None:
    """reward.scorers names only built-in scorers, `custom` with a custom function and
    `reward_model` with a reward model."""
    known = (
        set(SCORERS)
        | ({"custom"} if custom else set())
        | ({"reward_model"} if reward_model else set())
    )
    for source, weights in by_source.items():
        unknown = sorted(set(weights) - known)
        if unknown:
            raise KeelError(
                NO_SCORER,
                f"reward.scorers.{source} names {unknown}, which are not scorers",
                f"use built-in scorers {sorted(SCORERS)}"
                + (
                    " or custom" if custom else " (set custom_reward_function.path to use `custom`)"
                ),
            )


def _in_files(files: list[str]) -> str:
    """ " in `a.jsonl` or `b.jsonl`": where the rows a fix names are."""
    return "".join(f" in `{f}`" for f in files[:1]) + "".join(f" or `{f}`" for f in files[1:])


def overlong_penalty(lengths: torch.Tensor, max_response_length: int, cfg) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476): 0 up to max_response_length - len, then
    falling linearly to -penalty_factor at max_response_length."""
    exceed = lengths.float() - (max_response_length - cfg.len)  # [N]
    return torch.clamp(-exceed / cfg.len * cfg.penalty_factor, max=0.0)
