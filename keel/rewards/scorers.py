"""keel's rule scorers, GSM8K's as verl scores it among them. Each follows verl's reward contract:
`(data_source, solution_str, ground_truth, extra_info) -> float` (or a dict with `score`).

They serve keel's own data sources, or any data source that names them in `reward.scorers`. verl's
other rules are reproduced in keel/rewards/verl/; keel/rewards/registry.py names every scorer and
routes data sources to them.
"""

from __future__ import annotations

import re
from typing import Any

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
    """verl's GSM8K rule (verl/utils/reward_score/gsm8k.py, strict), so reward curves compare: in
    the last 300 characters, the last `#### <number>` with `,` and `$` removed must equal the ground
    truth as a string (`#### 72.` is not 72). One difference: a ground truth that is not a string is
    compared as its text (verl compares the string with the number itself, and scores 0)."""
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
    """Mathematical equivalence of the extracted answer and the ground truth (math-verify): `1/2`,
    `0.5` and `\\frac{1}{2}` are the same answer, boxed or after "the answer is". More lenient than
    verl's rules, so no data source picks it: name it in
    reward.scorers.<data_source>.math_equivalent."""
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
    """The chosen letter (boxed, 'the answer is (B)', or the bare letter) equals the ground
    truth's."""
    choice = extract_choice(solution_str)
    return float(choice is not None and choice == str(ground_truth).strip().strip("()").upper())


_THINK_ANSWER = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)


def think_answer_format(
    data_source: str, solution_str: str, ground_truth: Any = None, extra_info: dict | None = None
) -> float:
    """1.0 when the response is `<think>...</think><answer>...</answer>` and nothing else."""
    return float(_THINK_ANSWER.fullmatch(solution_str) is not None)


def arithmetic(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """keel's demo task: the response must be the integer answer and nothing else."""
    answer = solution_str.strip()
    return float(re.fullmatch(r"-?\d+", answer) is not None and int(answer) == int(ground_truth))


def tool_arithmetic(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> dict:
    """keel's tools demo: the final answer (the last assistant turn of a multi-turn rollout) must be
    the integer answer; `correct_call`: whether a tool's output was that answer (the right
    calculator call)."""
    info = extra_info or {}
    return {
        "score": arithmetic(data_source, info.get("last_turn", solution_str), ground_truth),
        "correct_call": float(str(ground_truth) in info.get("tool_outputs", [])),
    }
