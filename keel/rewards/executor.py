"""Run scoring tasks in worker processes, each under a time limit; a hung worker is killed."""

from __future__ import annotations

import asyncio
import inspect
import math
import multiprocessing
import threading
import time
from concurrent.futures import CancelledError
from dataclasses import dataclass
from multiprocessing.pool import AsyncResult

from keel.rewards.worker import SampleResult, SampleTask, resolve, score_sample, score_samples_async


def is_async(spec) -> bool:
    return inspect.iscoroutinefunction(resolve(spec))


# Spawned workers start in about a second (they import no torch); this covers it.
START_SLACK_S = 5.0
# How often a wait for a worker's result looks whether the run has ended meanwhile.
ENDED_POLL_S = 0.25


class ScoringEnded(CancelledError):
    """The run ended (the pool shut down) while a batch was being scored: its workers are gone,
    so its results will never come. Not a failure of the samples: an async run's batch in flight
    at the end is dropped, never counted as not scored."""


@dataclass(frozen=True)
class Started:
    """A sample's scoring, begun in the pool's worker processes."""

    # the pool it runs in (a pool closed since cannot answer)
    generation: int
    result: AsyncResult


class ScoringPool:
    """`num_workers=0` scores in this process (per-sample timeouts still apply, via SIGALRM)."""

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self._pool = None
        # pools started so far: a task started in a closed one is started again
        self._generation = 0
        # tasks started ahead of `run`, not yet known done
        self._queued: list[AsyncResult] = []
        # `start` may run on another thread than `run` (Ray ranks' finished samples arrive on one)
        self._lock = threading.Lock()
        # shut down for good: nothing starts ahead any more
        self._ended = False

    def start(self, task: SampleTask) -> Started | None:
        """Scoring one sample begun now in a worker process (the caller goes on: generation, say),
        its result read by `run`; None where `run` scores it itself (in this process, or async)."""
        if self.num_workers == 0 or self._ended or any(is_async(spec) for _, spec in task.scorers):
            # (after shutdown: a sample a Ray rank tells late starts no new pool)
            return None
        with self._lock:
            result = self._get_pool().apply_async(score_sample, (task,))
            self._queued.append(result)
            return Started(self._generation, result)

    def run(
        self,
        tasks: list[SampleTask],
        timeout_s: float | None,
        started: list[Started | None] | None = None,
    ) -> list[SampleResult]:
        """Each task's result: `started[i]`'s where `start` began task i in this pool, else scored
        now."""
        if any(is_async(spec) for task in tasks for _, spec in task.scorers):
            # I/O-bound scorers: concurrency, not processes
            return asyncio.run(score_samples_async(tasks))
        if self.num_workers == 0:
            return [score_sample(task) for task in tasks]
        with self._lock:
            # (a batch reaching here after the run ended would start a pool nobody closes)
            if self._ended:
                raise ScoringEnded("the run ended before this batch was scored")
            pool, generation = self._get_pool(), self._generation
            started = started or [None] * len(tasks)
            pending = [
                s.result
                if s is not None and s.generation == generation
                else pool.apply_async(score_sample, (task,))
                for task, s in zip(tasks, started)
            ]
            # Tasks started ahead (for samples trained later) may run before these: they count too.
            self._queued = [r for r in self._queued if not r.ready()]
            queued = len(set(self._queued) - set(pending))
        # The per-sample limit runs inside each worker; this batch deadline catches what a signal
        # cannot interrupt (a scorer stuck in C code, a worker that died mid-task).
        waves = math.ceil((len(tasks) + queued) / self.num_workers)
        deadline = time.monotonic() + timeout_s * waves + START_SLACK_S if timeout_s else None
        results, hung = [], False
        for future in pending:
            try:
                results.append(self._result(future, deadline))
            except multiprocessing.TimeoutError:
                results.append(SampleResult(None, "timeout (worker killed)", timeout_s or 0.0))
                hung = True
        if hung:
            # the next batch starts with fresh workers
            self.close()
        return results

    def _result(self, future: AsyncResult, deadline: float | None) -> SampleResult:
        """The worker's result, waited for until `deadline` (None: as long as it takes), or
        ScoringEnded as soon as the pool shuts down: a terminated pool never answers, and waiting
        out the deadline kept an async run's last batch, and so the process, alive for minutes."""
        while True:
            if self._ended:
                raise ScoringEnded("the run ended while this batch was scored")
            left = None if deadline is None else deadline - time.monotonic()
            try:
                return future.get(
                    timeout=ENDED_POLL_S if left is None else max(0.0, min(left, ENDED_POLL_S))
                )
            except multiprocessing.TimeoutError:
                if left is not None and left <= ENDED_POLL_S:
                    raise

    def _get_pool(self):
        if self._pool is None:
            self._pool = multiprocessing.get_context("spawn").Pool(self.num_workers)
        return self._pool

    def shutdown(self) -> None:
        """For good, at the end of a run: closed, and `start` begins nothing after."""
        self._ended = True
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._generation += 1
                self._queued = []
                self._pool.terminate()
                self._pool.join()
                self._pool = None
