"""Rewards: built-in scorers, custom reward functions, the code jail, the reward service and model.

`default_compute_score` is verl's routing of data sources to rule scorers, with verl's name and
signature, so a reward function can fall back to it as verl users' functions do:

    from keel.rewards import default_compute_score

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if data_source == "my_data":
            return my_rule(solution_str, ground_truth)
        return default_compute_score(data_source, solution_str, ground_truth, extra_info)

Imports stay inside the functions: importing any module of this package must not load the scorers.
"""

from __future__ import annotations

from typing import Any


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs
) -> float | dict:
    """The score verl 0.9.1's `default_compute_score` gives (a float, or math_dapo's dict {score,
    acc, pred}); a data source verl routes nowhere raises KEEL-R002. See
    keel/rewards/registry.py."""
    from keel.rewards.registry import default_compute_score as route

    return route(data_source, solution_str, ground_truth, extra_info, **kwargs)


def verl_scorer_name(data_source: str) -> str | None:
    """The keel scorer giving verl's rule for `data_source` ("openai/gsm8k" -> "gsm8k"), or None
    where verl routes it nowhere."""
    from keel.rewards.verl.routing import verl_scorer_name as name

    return name(data_source)


__all__ = ["default_compute_score", "verl_scorer_name"]
