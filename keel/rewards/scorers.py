"""Built-in rule scorers. Each follows verl's reward contract:
`(data_source, solution_str, ground_truth, extra_info) -> float`.
"""

from __future__ import annotations

import re
from typing import Any, Callable

RewardFn = Callable[[str, str, Any, dict], float]

_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def exact_match(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the ground truth."""
    return float(solution_str.strip() == str(ground_truth).strip())


def gsm8k(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """GSM8K's strict format: the last `#### <number>` in the response must equal the answer."""
    matches = _GSM8K_ANSWER.findall(solution_str)
    if not matches:
        return 0.0
    answer = matches[-1].replace(",", "").rstrip(".")
    truth = str(ground_truth).replace(",", "").strip()
    return float(answer == truth)


def arithmetic(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """keel's demo task: the response must be the integer answer and nothing else."""
    answer = solution_str.strip()
    return float(re.fullmatch(r"-?\d+", answer) is not None and int(answer) == int(ground_truth))


SCORERS: dict[str, RewardFn] = {"exact_match": exact_match, "gsm8k": gsm8k, "arithmetic": arithmetic}

# data_source values (as verl's datasets write them) that pick a built-in scorer.
DATA_SOURCE_SCORERS = {"openai/gsm8k": "gsm8k", "gsm8k": "gsm8k", "exact_match": "exact_match",
                       "keel/arithmetic": "arithmetic"}
