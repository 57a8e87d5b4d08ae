"""Every built-in scorer by name, and which one a data source picks: keel's rules
(keel/rewards/scorers.py) and verl's (keel/rewards/verl/), dispatched from here, above both.

`default_compute_score` is verl's routing with verl's name and signature, public as
`keel.rewards.default_compute_score`: a verl user's reward function that falls back to verl's
routing for the data sources it does not handle itself works unchanged.
"""

from __future__ import annotations

from typing import Any

from keel.errors import NO_SCORER, KeelError
from keel.rewards.contract import RewardFn
from keel.rewards.scorers import (
    arithmetic,
    exact_match,
    gsm8k,
    gsm8k_flexible,
    gsm8k_lenient,
    math_equivalent,
    multiple_choice,
    regex_match,
    think_answer_format,
    tool_arithmetic,
)
from keel.rewards.verl import code_tests, prime_math
from keel.rewards.verl.qa import search_r1
from keel.rewards.verl.routing import (
    VERL_DATA_SOURCES,
    VERL_PREFIX_ROUTE,
    verl_result,
    verl_scorer_name,
)
from keel.rewards.verl.verl_math import geo3k, math_dapo, math_reward

SCORERS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "gsm8k": gsm8k,
    "gsm8k_lenient": gsm8k_lenient,
    "gsm8k_flexible": gsm8k_flexible,
    "math_equivalent": math_equivalent,
    "regex": regex_match,
    "multiple_choice": multiple_choice,
    "think_answer_format": think_answer_format,
    "arithmetic": arithmetic,
    "tool_arithmetic": tool_arithmetic,
    "code_exec": code_tests.code_exec,
    # verl's rules, under verl's names (the module each reproduces: routing.VERL_MODULES)
    "math_reward": math_reward,
    "math_dapo": math_dapo,
    "prime_math": prime_math.prime_math,
    "prime_code": code_tests.prime_code,
    "geo3k": geo3k,
    "search_r1": search_r1,
}

# data_source values that pick a built-in scorer: every one verl 0.9.1 routes, to the scorer giving
# verl's score, and keel's own. Data sources starting with "aime" go to math_dapo too
# (scorer_for_source).
DATA_SOURCE_SCORERS = {
    **VERL_DATA_SOURCES,
    "aime2024": "math_dapo",
    "aime2025": "math_dapo",
    "gsm8k": "gsm8k",
    "exact_match": "exact_match",
    "keel/arithmetic": "arithmetic",
    "keel/tool_arithmetic": "tool_arithmetic",
    "code": "code_exec",
}

# Scorers that do not compare against a ground truth.
NO_GROUND_TRUTH = {"think_answer_format"}


def scorer_for_source(data_source: str) -> str | None:
    """The built-in scorer a data_source picks: DATA_SOURCE_SCORERS, verl's `aime*` prefix, then
    keel's rule that a name containing "gsm8k" is GSM8K; None when none does."""
    if data_source in DATA_SOURCE_SCORERS:
        return DATA_SOURCE_SCORERS[data_source]
    prefix, scorer = VERL_PREFIX_ROUTE
    if data_source.startswith(prefix):
        return scorer
    return "gsm8k" if "gsm8k" in data_source else None


def _verl_rule(
    scorer: str, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None
) -> Any:
    """The raw result of the rule `scorer` as verl's default_compute_score calls it."""
    if scorer == "prime_math":
        return prime_math.compute_score(solution_str, ground_truth)
    # verl's sandbox_fusion_url is not used: keel runs the tests in its own jail
    if scorer == "prime_code":
        return code_tests.compute_score(solution_str, ground_truth, continuous=True)
    return SCORERS[scorer](data_source, solution_str, ground_truth, extra_info)


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs
) -> float | dict:
    """verl's `default_compute_score`: the score of `solution_str` by the rule verl 0.9.1 uses for
    `data_source`, a float or (math_dapo) the dict {score, acc, pred}. verl's other keywords
    (sandbox_fusion_url, concurrent_semaphore, memory_limit_mb) are accepted and not used: code runs
    in keel's jail. A data source verl routes nowhere raises KEEL-R002 (verl:
    NotImplementedError)."""
    scorer = verl_scorer_name(data_source)
    if scorer is None:
        routed = sorted(VERL_DATA_SOURCES) + [f"{VERL_PREFIX_ROUTE[0]}*"]
        raise KeelError(
            NO_SCORER,
            f"default_compute_score has no rule for data_source={data_source!r}: verl 0.9.1 routes "
            f"only {', '.join(routed)}",
            f"score data_source={data_source!r} in your own function before falling back to "
            "keel.rewards.default_compute_score, or set the rows' data_source to one of those it "
            "routes (keel's own scorers are named in reward.scorers.<data_source>.<scorer>)",
        )
    return verl_result(_verl_rule(scorer, data_source, solution_str, ground_truth, extra_info))
