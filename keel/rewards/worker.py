"""Scoring one sample, in this process or a worker: every outcome is a number or a reason.

Kept free of torch so worker processes start in a fraction of a second.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel.rewards.contract import BATCHED, PER_SAMPLE, call_reward_fn, split_result

# A scorer is named by a spec that pickles: ("builtin", name) or ("file", path, function name,
# reward_kwargs as JSON). In this process a plain callable works too (tests, notebooks).
Spec = tuple | Callable


def file_spec(path: str, name: str, reward_kwargs: dict | None = None) -> tuple:
    return ("file", path, name, json.dumps(reward_kwargs or {}, sort_keys=True))


@dataclass
class SampleTask:
    # (name in the breakdown, scorer)
    scorers: list[tuple[str, Spec]]
    data_source: str
    response: str
    ground_truth: Any
    extra_info: dict
    timeout_s: float | None


@dataclass
class SampleResult:
    # per scorer; None when the sample was not scored
    values: dict[str, float] | None
    # why not: "timeout", "raised ValueError: ...", "not a number: None"
    reason: str | None
    seconds: float
    # the extra keys of dict results (verl's reward_extra_info)
    extras: dict | None = None


class ScoreTimeout(BaseException):
    """A scorer ran past reward.timeout_s. Not an Exception: a scorer's `except Exception` cannot
    swallow it (and one that swallows everything is caught by the clock afterwards)."""


class NotANumber(Exception):
    pass


# reasons of a NaN or inf score
NOT_FINITE = ("not a number: nan", "not a number: inf", "not a number: -inf")


# verl's two forms of custom_reward_function.path
PKG_PREFIX, FILE_PREFIX = "pkg://", "file://"


def load_module(path: str):
    """Import a custom reward function's module: a python file by path (`file://` before it
    allowed), or `pkg://package.module` (also `pkg://package/module`), as verl's load_module reads
    them."""
    if path.startswith(PKG_PREFIX):
        return importlib.import_module(
            path.removeprefix(PKG_PREFIX).replace("/", ".").removesuffix(".py")
        )
    file = Path(path.removeprefix(FILE_PREFIX))
    spec = importlib.util.spec_from_file_location(f"keel_custom_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def module_location(path: str) -> str:
    """What a worker process imports the function from: a file as an absolute path (workers may run
    elsewhere in the tree), a package module as it is."""
    return (
        path if path.startswith(PKG_PREFIX) else str(Path(path.removeprefix(FILE_PREFIX)).resolve())
    )


def load_file_function(path: str, name: str) -> Callable:
    return getattr(load_module(path), name)


@functools.cache
def _resolve_spec(spec: tuple) -> Callable:
    if spec[0] == "builtin":
        from keel.rewards.registry import SCORERS

        return SCORERS[spec[1]]
    fn = load_file_function(spec[1], spec[2])
    kwargs = json.loads(spec[3]) if len(spec) > 3 else {}
    return functools.partial(fn, **kwargs) if kwargs else fn


def resolve(spec: Spec) -> Callable:
    return spec if callable(spec) else _resolve_spec(spec)


def as_number(result: Any) -> float:
    """A scorer's result as a finite float: verl's {"score": x} dicts and 0-d tensors included."""
    result, _ = split_result(result)
    # numpy or torch scalar
    if hasattr(result, "item") and getattr(result, "ndim", 1) == 0:
        result = result.item()
    try:
        # bool is Real: True -> 1.0
        value = float(result) if isinstance(result, numbers.Real) else None
    # an integer past float's range, e.g. 10**400 from a service
    except OverflowError:
        value = math.inf
    if value is None or not math.isfinite(value):
        raise NotANumber(
            f"not a number: {result!r}"[:120] if value is None else f"not a number: {value}"
        )
    return value


def call_with_deadline(call: Callable[[], Any], seconds: float | None) -> Any:
    """call(), or ScoreTimeout once `seconds` have passed, enforced from outside the scorer. On the
    main thread (the trainer, a scoring worker) a SIGALRM that repeats every `seconds` interrupts
    it; on any other thread (the reward server's) it runs on a helper thread that is abandoned at
    the deadline. A scorer that returns late anyway is still a timeout (`score_sample`)."""
    if not seconds:
        return call()
    if threading.current_thread() is threading.main_thread():
        return _with_alarm(call, seconds)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        # handed to the waiting thread as it is
        except BaseException as error:
            outcome["error"] = error

    helper = threading.Thread(target=run, name="keel-scorer", daemon=True)
    helper.start()
    helper.join(seconds)
    if helper.is_alive():
        raise ScoreTimeout()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _with_alarm(call: Callable[[], Any], seconds: float) -> Any:
    def expire(signum, frame):
        raise ScoreTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    # again and again, if it is swallowed
    signal.setitimer(signal.ITIMER_REAL, seconds, seconds)
    try:
        return call()
    finally:
        # an alarm landing here must not leave the timer running on the trainer's thread
        while True:
            try:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
                break
            # the scorer's time was up anyway: score_sample counts it late
            except ScoreTimeout:
                continue


def _late(start: float, seconds: float | None) -> bool:
    return bool(seconds) and time.perf_counter() - start > seconds


def failure_reason(error: Exception) -> str:
    """Why a sample was not scored, as counted in reward/not_scored/<reason>."""
    import asyncio

    if isinstance(error, (ScoreTimeout, asyncio.TimeoutError)):
        return "timeout"
    if isinstance(error, NotANumber):
        return str(error)
    return f"raised {type(error).__name__}: {error}"[:160]


async def score_samples_async(tasks: list[SampleTask]) -> list[SampleResult]:
    """All samples at once, for scorers that are coroutines (they wait on a service or a judge)."""
    import asyncio

    async def one(task: SampleTask) -> SampleResult:
        start = time.perf_counter()
        try:
            outcome = _Outcome()
            for name, spec in task.scorers:
                result = _call(spec, task)
                if inspect.isawaitable(result):
                    result = await asyncio.wait_for(result, task.timeout_s)
                outcome.add(name, result)
        # the scorer is user code: any failure is this sample's, with its reason
        except Exception as e:
            return SampleResult(None, failure_reason(e), time.perf_counter() - start)
        # it swallowed the cancellation, or blocked the event loop
        if _late(start, task.timeout_s):
            return SampleResult(None, "timeout", time.perf_counter() - start)
        return SampleResult(outcome.values, None, time.perf_counter() - start, outcome.extras)

    return list(await asyncio.gather(*(one(task) for task in tasks)))


BATCHED_CONTRACT = (
    "custom_reward_function.batched=true calls the function once with four lists (data_sources=, "
    "solution_strs=, ground_truths=, extra_infos=) and expects a list of scores back"
)


def score_batched(fn: Callable, tasks: list[SampleTask]) -> list[SampleResult]:
    """One call for the whole batch: fn(data_sources, solution_strs, ground_truths, extra_infos) ->
    list."""
    start = time.perf_counter()
    limit = tasks[0].timeout_s * len(tasks) if tasks and tasks[0].timeout_s else None
    try:
        columns = (
            [t.data_source for t in tasks],
            [t.response for t in tasks],
            [t.ground_truth for t in tasks],
            [t.extra_info for t in tasks],
        )
        returned = call_with_deadline(lambda: call_reward_fn(fn, BATCHED, columns), limit)
        if _late(start, limit):
            raise ScoreTimeout()
        # a per-sample function
        if isinstance(returned, (str, bytes, dict)) or not hasattr(returned, "__len__"):
            raise NotANumber(
                f"not a number: the scorer returned {type(returned).__name__}; {BATCHED_CONTRACT}"
            )
        results = list(returned)
        if len(results) != len(tasks):
            raise NotANumber(
                f"not a number: the batched scorer returned {len(results)} scores for "
                f"{len(tasks)} samples"
            )
    # the scorer is user code: the batch fails together, with the reason
    except (Exception, ScoreTimeout) as e:
        reason = failure_reason(e)
        # often a per-sample function handed lists
        if reason.startswith("raised"):
            reason = f"{reason} ({BATCHED_CONTRACT})"
        return [SampleResult(None, reason, time.perf_counter() - start)] * len(tasks)
    seconds = (time.perf_counter() - start) / max(len(tasks), 1)
    out = []
    for task, result in zip(tasks, results):
        try:
            score, extras = split_result(result)
            out.append(SampleResult({task.scorers[0][0]: as_number(score)}, None, seconds, extras))
        except NotANumber as e:
            out.append(SampleResult(None, str(e), seconds))
    return out


def score_sample(task: SampleTask) -> SampleResult:
    start = time.perf_counter()
    outcome = _Outcome()
    try:
        call_with_deadline(
            lambda: [outcome.add(name, _call(spec, task)) for name, spec in task.scorers],
            task.timeout_s,
        )
    # the scorer is user code: any failure is this sample's, with its reason
    except (Exception, ScoreTimeout) as e:
        return SampleResult(None, failure_reason(e), time.perf_counter() - start)
    # it caught the alarm, or sat in C code the signal cannot enter
    if _late(start, task.timeout_s):
        return SampleResult(None, "timeout", time.perf_counter() - start)
    return SampleResult(outcome.values, None, time.perf_counter() - start, outcome.extras)


def _call(spec: Spec, task: SampleTask) -> Any:
    return call_reward_fn(
        resolve(spec),
        PER_SAMPLE,
        (task.data_source, task.response, task.ground_truth, task.extra_info),
    )


class _Outcome:
    """One sample's scores by scorer, and the extra keys their dict results carried."""

    def __init__(self):
        self.values: dict[str, float] = {}
        self.extras: dict = {}

    def add(self, name: str, result: Any) -> None:
        score, extras = split_result(result)
        self.values[name] = as_number(score)
        self.extras.update(extras)
