"""Turn responses into scores: pick a scorer per data_source, call it, refuse bad results."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from keel.rewards.ahead import StartedSample, begun, sample_task
from keel.rewards.choice import ScorerChoice
from keel.rewards.contract import AGENT_WEIGHTS, agent_reward
from keel.rewards.executor import ScoringPool
from keel.rewards.not_scored import NotScoredPolicy
from keel.rewards.row_checks import check_rows
from keel.rewards.score_metrics import score_metrics
from keel.rewards.worker import SampleResult, Spec, resolve, score_batched


@dataclass
class ScoreResult:
    scores: torch.Tensor  # [N]; 0 where not scored
    scored: torch.Tensor  # [N] bool
    reasons: list[str | None]  # [N] why a sample was not scored
    metrics: dict[str, float]
    # [N] dict results' other keys (verl's reward_extra_info)
    extras: list[dict] = field(default_factory=list)


class RewardScorer:
    """Scores a batch of responses; every sample is scored or marked not scored with a reason.

    Who scores which data_source: `ScorerChoice` (keel/rewards/choice.py). What a not-scored sample
    becomes (`on_error`: mask, zero or raise; past `max_not_scored_ratio` the run stops):
    `NotScoredPolicy` (keel/rewards/not_scored.py). The keywords are the reward config's, flat, as
    keel's setup and `keel reward-server` pass them; `custom` is the custom function, a callable or
    a spec tuple that pickles to the scoring processes (keel.rewards.worker.Spec).
    """

    def __init__(
        self,
        custom: Spec | None = None,
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
        self.choice = ScorerChoice(custom, by_source or {}, reward_model, service)
        self.not_scored = NotScoredPolicy(on_error, max_not_scored_ratio, nonfinite)
        # the same objects the choice names, used to score
        self.custom, self.reward_model, self.service = custom, reward_model, service
        self.batched = batched
        self.sandbox_require = sandbox_require
        self.overlong = overlong if overlong is not None and overlong.enable else None
        self.max_response_length = max_response_length
        self.timeout_s = timeout_s
        self.pool = ScoringPool(num_workers)

    def scorers_for(self, data_source: str) -> dict[str, tuple[Spec, float]]:
        """{name: (scorer spec, weight)} for one data_source."""
        return self.choice.scorers_for(data_source)

    def describe(self, data_source: str) -> str:
        """Who scores `data_source`, in words, for `keel check`."""
        return self.choice.describe(data_source)

    def user_code(self, data_source: str) -> str | None:
        """ "`function` in `file`" of the custom function that scores `data_source`, when one
        does."""
        return self.choice.user_code(data_source)

    def check_records(self, records: list, files: list[str] = ()) -> None:
        """Fail before any generation if some row could not be scored (keel/rewards/row_checks.py).
        `files`: the data files the records come from, for the fix line."""
        check_rows(self.choice, records, files, self.sandbox_require)

    def runs_model_code(self, records: list) -> bool:
        """Whether some row is scored by running the response (code_exec, in keel's sandbox)."""
        return any(self.choice.runs_code(source) for source in {r.data_source for r in records})

    # -> [N]
    def score(self, records: list, response_texts: list[str]) -> torch.Tensor:
        return self.score_batch(records, response_texts).scores

    @property
    def can_start(self) -> bool:
        """Whether `start` can begin samples ahead of their batch (scoring processes, scored one by
        one)."""
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
        return StartedSample.of_task(task, self.pool.start(task))

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
        `started[i]`: sample i's scoring as `start` began it (if None, or another task's: scored
        now)."""
        on_error = on_error or self.not_scored.on_error
        given = [agent_reward(r) for r in records]
        weights = [
            AGENT_WEIGHTS if g is not None else self.scorers_for(r.data_source)
            for r, g in zip(records, given)
        ]
        results, ahead = self._results(records, response_texts, given, weights, started)
        failed = self.not_scored.failures(
            results, records, response_texts, on_error, self.timeout_s, self.user_code
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
        self.not_scored.check_share(failed, records, may_skip)
        return ScoreResult(
            scores,
            scored,
            [res.reason for res in results],
            metrics,
            [res.extras or {} for res in results],
        )

    def _results(
        self, records: list, texts: list[str], given: list, weights: list[dict], started: list
    ) -> tuple[list[SampleResult], list | None]:
        """Each sample's result: the agent's reward where it `given` one, else the scorers'; and
        what `start` began for those the scorers score (None when nothing was passed)."""
        # what the agent left to the scorers
        rest = [i for i, g in enumerate(given) if g is None]
        tasks = [sample_task(records[i], weights[i], texts[i], self.timeout_s) for i in rest]
        ahead = [begun(started[i], task) for i, task in zip(rest, tasks)] if started else None
        scored_rest = iter(
            self._run(
                [records[i] for i in rest],
                [texts[i] for i in rest],
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
        return results, ahead

    def _run(
        self, records: list, texts: list[str], weights: list[dict], started: list
    ) -> list[SampleResult]:
        """Each sample's per-scorer values, or the reason it has none (`started`: what the pool
        began)."""
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
        """For good, at the end of a run: the scoring processes and a reward model pool's
        replicas."""
        self.pool.shutdown()
        if hasattr(self.reward_model, "shutdown"):
            self.reward_model.shutdown()


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


def overlong_penalty(lengths: torch.Tensor, max_response_length: int, cfg) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476): 0 up to max_response_length - len, then
    falling linearly to -penalty_factor at max_response_length."""
    exceed = lengths.float() - (max_response_length - cfg.len)  # [N]
    return torch.clamp(-exceed / cfg.len * cfg.penalty_factor, max=0.0)
