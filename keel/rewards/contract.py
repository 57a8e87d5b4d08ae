"""verl's reward contract: how a reward function is called, what it is told, what it may return.

verl calls `compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...,
**custom_reward_function.reward_kwargs)` by keyword, and a batched function (`reward_manager:
batch`) with `data_sources=, solution_strs=, ground_truths=, extra_infos=`. keel calls by keyword
too, always, passing the names a function declares (all of them to one that takes **kwargs), so
`compute_score(solution_str, ground_truth, data_source=None, extra_info=None)` gets what its names
ask for. A function that needs a parameter verl does not supply (`(ds, s, gt, ei)`, or a typo such
as `solution`) is refused before training (`check_signature`): binding it by position would hand
one parameter another's value.

A result is a number, or a dict with `score` and any other keys (verl's reward_extra_info): those
are logged and saved with the samples.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from keel.errors import REWARD_SIGNATURE, KeelError

# a per-sample reward function, as verl calls it: (data_source, solution_str, ground_truth,
# extra_info) -> a number (or a dict with "score")
RewardFn = Callable[[str, str, Any, dict], float]

PER_SAMPLE = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCHED = ("data_sources", "solution_strs", "ground_truths", "extra_infos")
# verl's num_turns for one prompt and one response (its single-turn agent loop)
SINGLE_TURN = 2


def call_reward_fn(fn: Callable, names: tuple[str, ...], values: tuple) -> Any:
    """fn called as verl calls it: by keyword, with the names among `names` it declares."""
    try:
        accepted = _keywords(fn, names)
    # an unhashable callable (an instance used as a scorer): not cached
    except TypeError:
        accepted = _keywords.__wrapped__(fn, names)
    return fn(**{name: value for name, value in zip(names, values) if name in accepted})


@lru_cache(maxsize=256)
def _keywords(fn: Callable, names: tuple[str, ...]) -> frozenset[str]:
    """The names to pass: those fn declares, or all of them when it takes **kwargs (or has no
    signature to read, as some builtins)."""
    parameters = _parameters(fn)
    if parameters is None or any(p.kind is p.VAR_KEYWORD for p in parameters):
        return frozenset(names)
    return frozenset(
        p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ) & set(names)


def _parameters(fn: Callable) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    # a builtin without a signature
    except (TypeError, ValueError):
        return None


def unsupplied(fn: Callable, names: tuple[str, ...]) -> list[str]:
    """fn's required parameters that a call by keyword with `names` leaves without a value: names of
    its own, and positional-only ones (which no keyword reaches)."""
    required = [
        p
        for p in _parameters(fn) or []
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    return [p.name for p in required if p.name not in names or p.kind is p.POSITIONAL_ONLY]


def check_signature(fn: Callable, names: tuple[str, ...], path: str, name: str) -> None:
    """Refuse, before any sample is scored, a function verl's keyword call could not bind
    (`path`, `name`: custom_reward_function's)."""
    missing = unsupplied(fn, names)
    if not missing:
        return
    call = ", ".join(f"{n}=..." for n in names)
    raise KeelError(
        REWARD_SIGNATURE,
        f"custom_reward_function {name}{_shown(fn)} in {path} needs {missing}, which "
        f"verl's call does not supply: verl (and keel) call it by keyword, as {name}({call}, "
        "**custom_reward_function.reward_kwargs)",
        f"in `{name}` in `{path}`, name the parameters as verl does ({', '.join(names)}; leave out "
        "those you do not use, or take **kwargs), or give "
        + ", ".join(missing)
        + " a default or a "
        "value in custom_reward_function.reward_kwargs",
    )


def _shown(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return ""


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
        # numpy or torch scalar
        if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
            value = value.item()
        if isinstance(value, (numbers.Real, str)):
            extras[str(key)[:64]] = value if not isinstance(value, str) else value[:200]
    return result.get("score"), extras


AGENT_WEIGHTS = {"agent": (("agent", None), 1.0)}


def agent_reward(record) -> float | None:
    """The reward agent code returned for its sample (rollout.agent.function), or None: left to the
    scorers."""
    value = (record.extra_info or {}).get("agent_reward")
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value != value
        or abs(value) == float("inf")
    ):
        return None
    return float(value)
