"""verl 0.9.1's routing of data sources to rule scorers (`verl.utils.reward_score.default_compute_score`),
as keel's: the same data sources go to keel scorers that give verl's scores.

Public as `keel.rewards.default_compute_score`, with verl's name and signature, so that a verl user's
reward function that falls back to verl's routing for the data sources it does not handle itself works
unchanged. Kept free of heavy imports: each rule is imported when first used.
"""

from __future__ import annotations

from typing import Any

from keel.errors import NO_SCORER, KeelError

# (keel scorer, the verl module whose rule it reproduces, the data sources verl sends to it), in
# verl's order.
VERL_ROUTES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("gsm8k", "gsm8k", ("openai/gsm8k",)),
    (
        "math_reward",
        "math_reward",
        ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"),
    ),
    ("math_dapo", "math_dapo", ("math_dapo", "math", "math_dapo_reasoning")),
    (
        "prime_math",
        "prime_math",
        (
            "numina_aops_forum",
            "numina_synthetic_math",
            "numina_amc_aime",
            "numina_synthetic_amc",
            "numina_cn_k12",
            "numina_olympiads",
        ),
    ),
    ("prime_code", "prime_code", ("codecontests", "apps", "codeforces", "taco")),
    ("geo3k", "geo3k", ("hiyouga/geometry3k",)),
    (
        "search_r1",
        "search_r1_like_qa_em",
        (
            "searchR1_nq",
            "searchR1_triviaqa",
            "searchR1_popqa",
            "searchR1_hotpotqa",
            "searchR1_2wikimultihopqa",
            "searchR1_musique",
            "searchR1_bamboogle",
        ),
    ),
)
# Every data source starting with this goes to math_dapo (verl tests it right after math_dapo's
# list, so a name in a later list that starts with it, had there been one, would go to math_dapo
# too).
VERL_PREFIX_ROUTE = ("aime", "math_dapo")

VERL_DATA_SOURCES: dict[str, str] = {
    source: scorer for scorer, _, sources in VERL_ROUTES for source in sources
}
VERL_MODULES: dict[str, str] = {
    scorer: f"verl.utils.reward_score.{module}" for scorer, module, _ in VERL_ROUTES
}


def verl_scorer_name(data_source: Any) -> str | None:
    """The keel scorer giving the rule verl 0.9.1's default_compute_score uses for `data_source` (e.g.
    "openai/gsm8k" -> "gsm8k", "aime2024" -> "math_dapo"), or None where verl routes it nowhere."""
    if not isinstance(data_source, str):
        return None
    for scorer, _, sources in VERL_ROUTES:
        if data_source in sources:
            return scorer
        if scorer == VERL_PREFIX_ROUTE[1] and data_source.startswith(VERL_PREFIX_ROUTE[0]):
            return scorer
    return None


def verl_result(result: Any) -> Any:
    """verl's normalisation of a rule's result: a dict is kept, a number becomes a float, a tuple or
    list becomes the float of its first item."""
    if isinstance(result, dict):
        return result
    if isinstance(result, (int, float, bool)):
        return float(result)
    return float(result[0])


def prime_math(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """verl's prime_math rule (the numina_* data sets), from keel.rewards.prime_math, as a number."""
    from keel.rewards import prime_math as rule

    return verl_result(rule.compute_score(solution_str, ground_truth))


def prime_code(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """verl's prime_code rule (codecontests, apps, codeforces, taco): the share of tests passed in keel's
    jail, from keel.rewards.code_tests."""
    from keel.rewards import code_tests

    return code_tests.prime_code(data_source, solution_str, ground_truth, extra_info)


def _verl_rule(
    scorer: str, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None
) -> Any:
    """The raw result of the rule `scorer` as verl's default_compute_score calls it."""
    if scorer == "prime_math":
        from keel.rewards import prime_math as rule

        return rule.compute_score(solution_str, ground_truth)
    # verl's sandbox_fusion_url is not used: keel runs the tests in its own jail
    if scorer == "prime_code":
        from keel.rewards import code_tests

        return code_tests.compute_score(solution_str, ground_truth, continuous=True)
    from keel.rewards.scorers import SCORERS

    return SCORERS[scorer](data_source, solution_str, ground_truth, extra_info)


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs
) -> float | dict:
    """verl's `default_compute_score`: the score of `solution_str` by the rule verl 0.9.1 uses for
    `data_source`, a float or (math_dapo) the dict {score, acc, pred}. verl's other keywords
    (sandbox_fusion_url, concurrent_semaphore, memory_limit_mb) are accepted and not used: code runs in
    keel's jail. A data source verl routes nowhere raises KEEL-R002 (verl: NotImplementedError)."""
    scorer = verl_scorer_name(data_source)
    if scorer is None:
        routed = sorted(VERL_DATA_SOURCES) + [f"{VERL_PREFIX_ROUTE[0]}*"]
        raise KeelError(
            NO_SCORER,
            f"default_compute_score has no rule for data_source={data_source!r}: verl 0.9.1 routes "
            f"only {', '.join(routed)}",
            f"score data_source={data_source!r} in your own function before falling back to "
            "keel.rewards.default_compute_score, or set the rows' data_source to one of those it routes "
            "(keel's own scorers are named in reward.scorers.<data_source>.<scorer>)",
        )
    return verl_result(_verl_rule(scorer, data_source, solution_str, ground_truth, extra_info))
