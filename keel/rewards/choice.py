"""Which scorers score a data source, with what weights, and how that reads in words.

Per data_source: the reward service when there is one; else the weighted scorers named in
`reward.scorers`; else the reward model; else the custom function (it serves every data_source, as
in verl); else the built-in scorer for that data_source. The name `custom` in `reward.scorers`
refers to the custom function, so it can be combined with rules.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from keel.errors import NO_SCORER, KeelError
from keel.errors.fixes import setting
from keel.rewards.registry import (
    DATA_SOURCE_SCORERS,
    NO_GROUND_TRUTH,
    SCORERS,
    scorer_for_source,
)
from keel.rewards.worker import Spec

# scorers that run the response
RUN_CODE = (("builtin", "code_exec"), ("builtin", "prime_code"))
# the spec naming the reward model in a data_source's scorers
REWARD_MODEL = ("reward_model",)
SERVICE = ("service",)


@dataclass
class ScorerChoice:
    """Who scores each data source. `custom`: the custom function, a callable or a spec that pickles
    to the scoring processes (keel.rewards.worker.Spec); `by_source`: reward.scorers;
    `reward_model` and `service`: the reward model and the reward service client, when
    configured."""

    custom: Spec | None = None
    by_source: dict[str, dict[str, float]] = field(default_factory=dict)
    reward_model: Any = None
    service: Any = None

    def __post_init__(self) -> None:
        _check_scorer_names(self.by_source, bool(self.custom), bool(self.reward_model))

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
                f"no scorer for data_source={data_source!r}; built-in ones serve "
                f"{sorted(DATA_SOURCE_SCORERS)} and every data_source starting with 'aime' "
                "(verl's routing)",
                f"set {setting(f'reward.scorers.{data_source}.exact_match', 1.0)} (1 when the "
                "response is the row's ground truth, else 0), or set custom_reward_function.path "
                "to a file with compute_score(data_source, solution_str, ground_truth, "
                "extra_info)",
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
        """ "`function` in `file`" of the custom function that scores `data_source`, when one
        does."""
        spec = self.scorers_for(data_source).get("custom", (None,))[0]
        if isinstance(spec, tuple):
            return f"`{spec[2]}` in `{spec[1]}`" if spec[:1] == ("file",) else None
        # a functools.partial when reward_kwargs are bound
        function = getattr(spec, "func", spec)
        try:
            return f"`{function.__name__}` in `{inspect.getsourcefile(function)}`"
        except (TypeError, AttributeError):
            return None

    def runs_code(self, data_source: str) -> bool:
        """Whether `data_source` is scored by running the response (in keel's sandbox)."""
        return any(spec in RUN_CODE for spec, _ in self.scorers_for(data_source).values())

    def needs_ground_truth(self, data_source: str) -> bool:
        """Whether a built-in scorer that compares against the ground truth scores `data_source`."""
        return any(
            name in SCORERS and name not in NO_GROUND_TRUTH
            for name in self.scorers_for(data_source)
        )


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
