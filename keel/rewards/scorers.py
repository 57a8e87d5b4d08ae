"""Built-in rule scorers. Each follows verl's reward contract:
`(data_source, solution_str, ground_truth, extra_info) -> float` (or a dict with `score`).

The data sources verl 0.9.1's default_compute_score routes go to the scorers that reproduce verl's
rules (keel/rewards/verl_math.py, verl_qa.py, verl_routing.py); keel's own scorers serve keel's own
data sources, or any data source that names them in `reward.scorers`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from keel.rewards.verl_math import geo3k, math_dapo, math_reward
from keel.rewards.verl_qa import search_r1
from keel.rewards.verl_routing import VERL_DATA_SOURCES, VERL_PREFIX_ROUTE, prime_code, prime_math

RewardFn = Callable[[str, str, Any, dict], float]

_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*|-?\.\d+")


def _normalise_number(text: str) -> str:
    return text.replace(",", "").rstrip(".").strip()


def exact_match(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the ground truth."""
    return float(solution_str.strip() == str(ground_truth).strip())


# verl reads only the end of a response
VERL_GSM8K_CLIP_CHARS = 300


def gsm8k(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """verl's GSM8K rule (verl/utils/reward_score/gsm8k.py, strict), so reward curves compare: in the
    last 300 characters, the last `#### <number>` with `,` and `$` removed must equal the ground
    truth as a string (`#### 72.` is not 72). One difference: a ground truth that is not a string
    is compared as its text (verl compares the string with the number itself, and scores 0)."""
    matches = _GSM8K_STRICT.findall(solution_str[-VERL_GSM8K_CLIP_CHARS:])
    return float(
        bool(matches) and matches[-1].replace(",", "").replace("$", "") == str(ground_truth)
    )


def gsm8k_lenient(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """GSM8K's strict format read kindly: the last `#### <number>` anywhere in the response, with
    thousands separators and a trailing full stop dropped on both sides, must equal the answer."""
    matches = _GSM8K_STRICT.findall(solution_str)
    return float(
        bool(matches) and _normalise_number(matches[-1]) == _normalise_number(str(ground_truth))
    )


def gsm8k_flexible(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """GSM8K's flexible mode: the last number anywhere in the response must equal the answer."""
    numbers = _NUMBER.findall(solution_str)
    return float(
        bool(numbers) and _normalise_number(numbers[-1]) == _normalise_number(str(ground_truth))
    )


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}), braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    # unbalanced: the response was cut off
    return None


_FINAL_ANSWER = re.compile(
    r"(?:final answer|answer is)\s*:?\s*\$?([^\n$]+?)\$?\s*\.?\s*$", re.IGNORECASE | re.MULTILINE
)


def extract_math_answer(text: str) -> str | None:
    """The boxed answer, else the text after 'the answer is' / 'final answer:'."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    matches = _FINAL_ANSWER.findall(text)
    return matches[-1].strip() if matches else None


def math_equivalent(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """Mathematical equivalence of the extracted answer and the ground truth (math-verify): `1/2`, `0.5`
    and `\\frac{1}{2}` are the same answer, boxed or after "the answer is". More lenient than verl's
    rules, so no data source picks it: name it in reward.scorers.<data_source>.math_equivalent."""
    from math_verify import parse, verify

    answer = extract_math_answer(solution_str)
    if answer is None:
        return 0.0
    # math-verify's own timeouts use SIGALRM, which works on the main thread only (not on the reward
    # server's) and cancels keel's alarm; keel's reward.timeout_s bounds the whole scorer instead.
    gold = parse(
        f"${ground_truth}$" if "$" not in str(ground_truth) else str(ground_truth),
        parsing_timeout=None,
    )
    predicted = parse(f"${answer}$", parsing_timeout=None)
    return float(bool(gold) and bool(predicted) and verify(gold, predicted, timeout_seconds=None))


def regex_match(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """The ground truth is a regular expression the whole (stripped) response must match."""
    return float(re.fullmatch(str(ground_truth), solution_str.strip(), re.DOTALL) is not None)


_CHOICE_PATTERNS = [
    re.compile(r"\\boxed\{\s*\(?([A-J])\)?\s*\}"),
    re.compile(r"answer is\s*:?\s*\(?([A-J])\)?(?![A-Za-z])", re.IGNORECASE),
    # the response is just the letter
    re.compile(r"^\s*\(?([A-J])\)?[.)]?\s*$", re.IGNORECASE),
    # a parenthesised letter anywhere (the last one counts)
    re.compile(r"\(([A-J])\)"),
]


def extract_choice(text: str) -> str | None:
    for pattern in _CHOICE_PATTERNS:
        found = pattern.findall(text)
        if found:
            return found[-1].upper()
    return None


def multiple_choice(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """The chosen letter (boxed, 'the answer is (B)', or the bare letter) equals the ground truth's."""
    choice = extract_choice(solution_str)
    return float(choice is not None and choice == str(ground_truth).strip().strip("()").upper())


_THINK_ANSWER = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)


def think_answer_format(
    data_source: str, solution_str: str, ground_truth: Any = None, extra_info: dict | None = None
) -> float:
    """1.0 when the response is `<think>...</think><answer>...</answer>` and nothing else."""
    return float(_THINK_ANSWER.fullmatch(solution_str) is not None)


_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last fenced code block, else the whole response."""
    blocks = _CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else text


def code_exec(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """Share of test cases the program passes, in keel's sandbox: keel's [{"input", "output"}] form or
    verl's {"inputs", "outputs"} (keel/rewards/code_tests.py)."""
    from keel.rewards.code_tests import code_exec as score_tests

    return score_tests(data_source, solution_str, ground_truth, extra_info)


def arithmetic(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """keel's demo task: the response must be the integer answer and nothing else."""
    answer = solution_str.strip()
    return float(re.fullmatch(r"-?\d+", answer) is not None and int(answer) == int(ground_truth))


def tool_arithmetic(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> dict:
    """keel's tools demo: the final answer (the last assistant turn of a multi-turn rollout) must be the
    integer answer; `correct_call`: whether a tool's output was that answer (the right calculator call)."""
    info = extra_info or {}
    return {
        "score": arithmetic(data_source, info.get("last_turn", solution_str), ground_truth),
        "correct_call": float(str(ground_truth) in info.get("tool_outputs", [])),
    }


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
    "code_exec": code_exec,
    # verl's rules, under verl's names (the module each reproduces: verl_routing.VERL_MODULES)
    "math_reward": math_reward,
    "math_dapo": math_dapo,
    "prime_math": prime_math,
    "prime_code": prime_code,
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


def scorer_for_source(data_source: str) -> str | None:
    """The built-in scorer a data_source picks: DATA_SOURCE_SCORERS, verl's `aime*` prefix, then keel's
    rule that a name containing "gsm8k" is GSM8K; None when none does."""
    if data_source in DATA_SOURCE_SCORERS:
        return DATA_SOURCE_SCORERS[data_source]
    prefix, scorer = VERL_PREFIX_ROUTE
    if data_source.startswith(prefix):
        return scorer
    return "gsm8k" if "gsm8k" in data_source else None


# Scorers that do not compare against a ground truth.
NO_GROUND_TRUTH = {"think_answer_format"}
