"""verl's reward contract: how a reward function is called, what it is told, what it may return.

verl calls `compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...,
**custom_reward_function.reward_kwargs)` by keyword, and a batched function (`reward_manager:
batch`) with `data_sources=, solution_strs=, ground_truths=, extra_infos=`. keel does the same, so
`compute_score(solution_str, ground_truth, data_source=None, extra_info=None)` and
`compute_score(solution_str, ground_truth, **kwargs)` get what their names ask for. A function
whose parameters carry none of those names (keel's first contract: four positional parameters,
`(ds, s, gt, ei)`) is called by position, in verl's order.

A result is a number, or a dict with `score` and any other keys (verl's reward_extra_info): those
are logged and saved with the samples.
"""

from __future__ import annotations

import inspect
import numbers
from functools import lru_cache
from typing import Any, Callable

PER_SAMPLE = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCHED = ("data_sources", "solution_strs", "ground_truths", "extra_infos")
SINGLE_TURN = 2  # verl's num_turns for one prompt and one response (its single-turn agent loop)


def call_reward_fn(fn: Callable, names: tuple[str, ...], values: tuple) -> Any:
    """fn called as verl calls it: by keyword when its parameters are verl's names (or it takes
    **kwargs), else by position."""
    try:
        accepted = _keywords(fn, names)
    except TypeError:  # an unhashable callable (an instance used as a scorer): not cached
        accepted = _keywords.__wrapped__(fn, names)
    if accepted is None:
        return fn(*values)
    return fn(**{name: value for name, value in zip(names, values) if name in accepted})


@lru_cache(maxsize=256)
def _keywords(fn: Callable, names: tuple[str, ...]) -> frozenset[str] | None:
    """The names to pass by keyword, or None to call by position: a function whose required
    parameters are all among `names` (one at least), or that takes **kwargs."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature
        return None
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = {p.name for p in parameters if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if not required <= set(names):  # `(ds, s, gt, ei, **kw)`: positional names of its own
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return frozenset(names)
    return frozenset(named & set(names)) if named & set(names) else None


def verl_extra_info(extra_info: dict | None) -> dict:
    """The sample's extra_info with the keys verl adds before scoring, where the rollout has not set
    them (a multi-turn rollout counts its turns), as a copy: the dataset's record is not changed."""
    return {"num_turns": SINGLE_TURN, "rollout_reward_scores": {}, **(extra_info or {})}


def split_result(result: Any) -> tuple[Any, dict]:
    """(the score, the extra keys) of a result: a dict's `score` and its other keys with values
    a log can hold (numbers, booleans, short strings); anything else is the score itself."""
    if not isinstance(result, dict):
        return result, {}
    extras = {}
    for key, value in result.items():
        if key == "score":
            continue
        if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # numpy or torch scalar
            value = value.item()
        if isinstance(value, (numbers.Real, str)):
            extras[str(key)[:64]] = value if not isinstance(value, str) else value[:200]
    return result.get("score"), extras
