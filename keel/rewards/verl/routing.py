"""verl 0.9.1's routing of data sources to rule scorers
(`verl.utils.reward_score.default_compute_score`), as keel's: the same data sources go to keel
scorers that give verl's scores.

The table only: which keel scorer gives verl's rule for a data source. keel/rewards/registry.py
calls the rules (`default_compute_score`, public as `keel.rewards.default_compute_score`). Kept free
of imports of the rules, so `keel.rewards.verl_scorer_name` loads none of them.
"""

from __future__ import annotations

from typing import Any

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
    """The keel scorer giving the rule verl 0.9.1's default_compute_score uses for `data_source`
    (e.g. "openai/gsm8k" -> "gsm8k", "aime2024" -> "math_dapo"), or None where verl routes it
    nowhere."""
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
