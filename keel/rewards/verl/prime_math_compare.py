"""The comparisons behind verl 0.9.1's `prime_math` scorer, in keel's own code: the MATH data set's
string normalisation (`normalize_answer`) and ToRA's `math_equal` (numbers, percentages, tuples,
intervals, matrices), with `literal_value` (keel.rewards.verl.literals), keel's stand-in for the
`eval()` verl runs on the model's answer.

The rules follow verl's to the character, because a verl user's reward curve must not move when
the trainer changes. Where verl runs model-written text as Python (`eval` after substituting
`\\pi`, `eval` and sympy's `parse_expr` on matrix answers), keel evaluates literal arithmetic only,
so a response cannot run code in the trainer; anything else counts as "did not evaluate", as a
Python error does in verl.
"""

from __future__ import annotations

import math
import re
from math import isclose

from keel.rewards.verl.literals import literal_value, parse_literal_matrix

# The MATH set's brace and slash rules, shared with verl's math_reward rule (the same in both of
# verl's copies).
from keel.rewards.verl.verl_math import braced_frac_arguments, braced_sqrt_arguments, slash_as_frac

# an answer that is all `\text{...}`
TEXT_WRAPPED = re.compile(r"^\\text\{(?P<text>.+?)\}$")

# ---------------------------------------------------------------- MATH (Hendrycks) normalisation


def normalize_answer(answer: str | None) -> str | None:
    """The answer with LaTeX noise (spacing, `\\left`, degrees, dollars, units after `\\text{ `,
    percent signs) removed and fractions braced, so two spellings of one answer are equal strings.
    When a step fails (e.g. `\\sqrt` at the very end) verl keeps the answer as it then was."""
    if answer is None:
        return None
    answer = answer.strip()
    try:
        wrapped = TEXT_WRAPPED.search(answer)
        if wrapped is not None:
            answer = wrapped.group("text").strip()
        return _strip_latex_noise(answer)
    # verl's rule: any failure leaves the answer as it is
    except Exception:
        return answer


def _strip_latex_noise(text: str) -> str:
    text = text.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac")
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    text = _drop_trailing_units(text)
    text = text.replace("\\\\%", "").replace("\\%", "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    # "k = 3" -> "3"
    if len(sides) == 2 and len(sides[0]) <= 2:
        text = sides[1]
    text = braced_sqrt_arguments(text).replace(" ", "")
    text = braced_frac_arguments(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return slash_as_frac(text)


def _drop_trailing_units(text: str) -> str:
    """`5 \\text{ cm}` -> `5 `; MATH writes units after `\\text{ ` (with the space)."""
    if "\\text{ " not in text:
        return text
    parts = text.split("\\text{ ")
    if len(parts) != 2:
        # verl asserts here: the whole normalisation is dropped
        raise ValueError("more than one unit")
    return parts[0]


# ---------------------------------------------------------------- ToRA's math_equal

_DOLLAR_NUMBER = re.compile(r"\$\d+(\.\d+)?")
_PERCENT_NUMBER = (re.compile(r"^\d+(\.\d+)?%$"), re.compile(r"^\d+(\.\d+)?\\%$"))
_INTERVALS = (
    (re.compile(r"^Interval\((.*)\)$"), "[", "]"),
    (re.compile(r"^Interval\.Ropen\((.*)\)$"), "[", ")"),
    (re.compile(r"^Interval\.Lopen\((.*)\)$"), "(", "]"),
    (re.compile(r"^Interval\.open\((.*)\)$"), "(", ")"),
)
PMATRIX = r"\begin{pmatrix}"


def math_equal(
    prediction,
    reference,
    include_percentage: bool = True,
    tolerance: float = 1e-4,
    pi: float = math.pi,
) -> bool:
    """ToRA's comparison as verl 0.9.1 runs it. Its last step, sympy's `symbolic_equal`, never
    compares in 0.9.1 (it enters `with timeout_limit(...)`, a decorator factory, which raises a
    TypeError that verl catches), so it is False here. Errors propagate as verl's do: the caller
    decides what an error means."""
    prediction = _tora_normalize(prediction, pi)
    reference = _tora_normalize(reference, pi)
    if isinstance(prediction, str) and len(prediction) > 1000:
        prediction = prediction[:1000]
    if (
        isinstance(prediction, str)
        and isinstance(reference, str)
        and (
            prediction.strip().lower() == reference.strip().lower()
            or prediction.replace(" ", "") == reference.replace(" ", "")
        )
    ):
        return True
    numeric = _numeric_verdict(prediction, reference, include_percentage, tolerance)
    if numeric is not None:
        return numeric
    if not prediction and prediction not in [0, False]:
        return False
    reference = str(reference).strip()
    return _structural_equal(str(prediction).strip(), reference, include_percentage, tolerance)


def _tora_normalize(answer, pi: float):
    if isinstance(answer, str) and _DOLLAR_NUMBER.match(answer):
        return answer[1:]
    if isinstance(answer, str) and any(pattern.match(answer) for pattern in _PERCENT_NUMBER):
        return answer.replace("\\%", "").replace("%", "")
    # `1010_2`: the digits before the base (may raise)
    if isinstance(answer, str) and "_" in answer:
        return int(float(answer.split("_")[0]))
    return _substitute_pi(answer, pi)


def _substitute_pi(answer, pi: float):
    """`2\\pi` -> `2*3.14159...`, `\\pi` -> `1*3.14159...`, then the value when it evaluates."""
    if not (isinstance(answer, str) and "\\pi" in answer):
        return answer
    at = answer.find("\\pi")
    while at != -1:
        factor = "*" if at > 0 and answer[at - 1].isdigit() else "1*"
        answer = answer[:at] + f"{factor}{pi}" + answer[at + 3 :]
        at = answer.find("\\pi", at + 1)
    try:
        return literal_value(answer)
    # verl: eval() failed, the text stays
    except Exception:
        return answer


def _as_number(value) -> tuple[bool, float | None]:
    """(True, number) when the text reads as a number once thousands commas (`{,}` or `,`) go."""
    try:
        text = str(value)
        return True, float(text.replace("{,}", "") if "{,}" in text else text.replace(",", ""))
    except ValueError:
        return False, None


def _numeric_verdict(
    prediction, reference, include_percentage: bool, tolerance: float
) -> bool | None:
    """Equal within `tolerance` (the reference also read as a percentage either way) when both are
    numbers; None when they are not both numbers."""
    try:
        if not (_as_number(prediction)[0] and _as_number(reference)[0]):
            return None
        predicted, expected = _as_number(prediction)[1], _as_number(reference)[1]
        candidates = (
            [expected / 100, expected, expected * 100] if include_percentage else [expected]
        )
        return any(isclose(candidate, predicted, rel_tol=tolerance) for candidate in candidates)
    except Exception:
        return None


def _structural_equal(
    prediction: str, reference: str, include_percentage: bool, tolerance: float
) -> bool:
    """Brackets ignored, then part by part: intervals and tuples, comma lists, `Point(...)`,
    matrices."""
    prediction = _interval_as_brackets(prediction)
    if _equal_without_brackets(prediction, reference):
        return True
    if (
        prediction
        and reference
        and prediction[0] in "(["
        and prediction[-1] in ")]"
        and prediction[0] == reference[0]
        and prediction[-1] == reference[-1]
    ):
        if _parts_equal(
            prediction[1:-1].split(","), reference[1:-1].split(","), include_percentage, tolerance
        ):
            return True
    if "," in prediction and "," in reference:
        predicted_parts = [part.strip() for part in prediction.split(",")]
        expected_parts = [part.strip() for part in reference.split(",")]
        if len(predicted_parts) == len(expected_parts):
            return _parts_equal(predicted_parts, expected_parts, include_percentage, tolerance)
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":
        predicted_parts = prediction[prediction.find("(") + 1 : -1].split(",")
        if _parts_equal(predicted_parts, reference[1:-1].split(","), include_percentage, tolerance):
            return True
    if PMATRIX in reference and prediction.startswith("Matrix"):
        return _sympy_matrix_equal(prediction, reference, include_percentage, tolerance)
    if PMATRIX in reference and prediction.startswith("[") and prediction.endswith("]"):
        return _list_matrix_equal(prediction, reference, include_percentage, tolerance)
    return False


def _parts_equal(
    predicted: list, expected: list, include_percentage: bool, tolerance: float
) -> bool:
    """Same length and pairwise equal. Every pair is compared (a list, not a generator), so an error
    in any pair propagates as it does in verl. Nested comparisons use the default pi, as verl's
    do."""
    return len(predicted) == len(expected) and all(
        [math_equal(p, e, include_percentage, tolerance) for p, e in zip(predicted, expected)]
    )


def _interval_as_brackets(prediction: str) -> str:
    """sympy's `Interval.Ropen(a, b)` -> `[a, b)` and the like."""
    for pattern, left, right in _INTERVALS:
        match = pattern.match(prediction)
        if match:
            return f"{left}{match.group(1)}{right}"
    return prediction


def _equal_without_brackets(prediction: str, reference: str) -> bool:
    if (
        prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")
    ) or (
        prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("[")
    ):
        prediction, reference = prediction.strip("[]()"), reference.strip("[]()")
    for bracket in "{}()":
        prediction, reference = prediction.replace(bracket, ""), reference.replace(bracket, "")
    return prediction == reference


def _sympy_matrix_equal(
    prediction: str, reference: str, include_percentage: bool, tolerance: float
) -> bool:
    """`Matrix([[1], [2]])` against `\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}`, entry by entry."""
    try:
        entries = parse_literal_matrix(prediction)
        expected = reference.split()[1:-1:2]
        return len(entries) == len(expected) and all(
            [
                math_equal(entry, item, include_percentage, tolerance)
                for item, entry in zip(expected, entries)
            ]
        )
    # verl: a failed parse or comparison is "not equal"
    except Exception:
        return False


def _list_matrix_equal(
    prediction: str, reference: str, include_percentage: bool, tolerance: float
) -> bool:
    """`[[1, 2], [3, 4]]` against a pmatrix, row by row. A prediction that does not evaluate raises,
    as verl's bare `eval` does."""
    if not isinstance(literal_value(prediction), list):
        return False
    try:
        rows_predicted = literal_value(prediction)
        body = (
            reference.removeprefix(r"\\begin{pmatrix}")
            .removeprefix(PMATRIX)
            .removesuffix(r"\\end{pmatrix}")
            .removesuffix(r"\end{pmatrix}")
        )
        rows = [row.split("&") if "&" in row else row for row in body.split("\\")]
        return len(rows_predicted) == len(rows) and all(
            [
                math_equal(row_p, row, include_percentage, tolerance)
                for row, row_p in zip(rows, rows_predicted)
            ]
        )
    except Exception:
        return False
