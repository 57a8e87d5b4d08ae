"""verl 0.9.1's `prime_math` scorer, which verl's `default_compute_score` uses for the `numina_*`
data sources (numina_aops_forum, numina_synthetic_math, numina_amc_aime, numina_synthetic_amc,
numina_cn_k12, numina_olympiads), in keel's own code.

`compute_score(model_output, ground_truth)` returns verl's triple (correct, well formatted,
extracted answer); verl's router scores `float(triple[0])`. The answer is taken as verl takes it
(after `answer:` / `the answer is`, else the last `\\boxed{}`, else after the last `is`, `=`, ...),
then graded in two passes, as verl does: PRM800K's grader (MATH normalisation, then sympy on each
element of a tuple), then ToRA's `math_equal` (numbers within 1e-4, percentages, intervals,
matrices), the latter twice (pi as 3.14159... and as 3.14) when `\\pi` appears.

Timeouts. verl bounds each sympy comparison with its multiprocessing `timeout_limit` (10 s, a
forked process per comparison) and scores a comparison that runs past it 0. keel does not fork
or set its own alarm: the reward worker (`keel/rewards/worker.py`) already bounds the whole scorer
with reward.timeout_s, by SIGALRM on the main thread and by abandoning a helper thread elsewhere,
and a nested alarm would cancel that one. So keel passes no inner timeout, as its math scorer does.
Known difference: a comparison that takes sympy more than 10 s scores 0 in verl; in keel it runs
on, and the sample scores what sympy finds or is "not scored (timeout)" past reward.timeout_s.

Model-written text is hostile. verl 0.9.1 runs the answer through `eval` (after substituting
`\\pi`, and on `[...]` answers to pmatrix references) and through sympy's `parse_expr` (also
eval underneath), so a response such as `\\boxed{re('\\textbackslash{}137...')}` runs arbitrary
code in verl's trainer. keel evaluates literal arithmetic only (`literals.literal_value`),
hands sympy no expression with a quote (a string is the only way to code through it) or with an
integer power too large to build, and hands `parse_expr` only literal `Matrix(...)` answers. Those
answers (and the rare ones only Python code evaluates, like `abs(-2)*\\pi`) are where keel's
scores may differ from verl's; tests/unit/test_prime_math.py lists them.
"""

from __future__ import annotations

import math
import re
from typing import Any

from keel.rewards.verl.literals import power_too_large
from keel.rewards.verl.prime_math_compare import TEXT_WRAPPED, math_equal, normalize_answer

_UNITS = [
    re.compile(f"{unit}(es)?(s)? *(\\^[0-9]+)?")
    for unit in (
        "degree",
        "cm",
        "centimeter",
        "meter",
        "mile",
        "second",
        "minute",
        "hour",
        "day",
        "week",
        "month",
        "year",
        "foot",
        "feet",
        "inch",
        "yard",
        "liter",
    )
]
_LATEX_SYMBOLS = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"))
_THOUSANDS_COMMA = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_TUPLE_BRACKETS = "()[]"
# sympy may hang on these (PRM800K's list): powers of braced or long exponents, towers
_RISKY_POWERS = ("^{", "^(")
_RISKY_POWER_PATTERNS = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_INTEGER_POWER_CHAIN = re.compile(r"\d+(?:\*\*\d+)+")
_LARGE_FACTORIAL = re.compile(r"\d{7,}\s*!")


def compute_score(model_output: str, ground_truth: str) -> tuple[bool, bool, str]:
    """(correct, well formatted, extracted answer), as verl 0.9.1's prime_math.compute_score."""
    model_output, ground_truth = str(model_output), str(ground_truth)
    answer = extract_answer(model_output)
    well_formatted = "Step 2:" in model_output and "\\box" in model_output
    if grade_answer(answer, ground_truth):
        return True, True, answer
    try:
        if "\\pi" in answer or "\\pi" in ground_truth:
            # both readings of pi are tried (a list, not any() over a generator): an error in
            # either makes the answer wrong, as in verl
            verdicts = [math_equal(answer, ground_truth, pi=pi) for pi in (math.pi, 3.14)]
            correct = any(verdicts)
        else:
            correct = math_equal(answer, ground_truth)
    # verl's rule: a comparison that fails is a wrong answer
    except Exception:
        correct = False
    return correct, well_formatted, answer


def prime_math(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """The scorer verl's router makes of the rule (the numina_* data sets): `float(triple[0])`."""
    return float(compute_score(solution_str, ground_truth)[0])


# ---------------------------------------------------------------- the answer in a response


def extract_answer(response: str) -> str:
    """The text after the last `answer:` / `answer is` / `answers are`, before a trailing `is the
    answer`, inside the last `\\boxed{}`, before the last `. `, and after the last `is ` / `=` / ...
    Markers are found in the lowercased text and cut from the original, as verl does."""
    for marker in ("answer:", "answer is", "answers are"):
        at = response.lower().rfind(marker)
        if at != -1:
            response = response[at + len(marker) :].strip()
    for marker in ("is answer", "is the answer", "are answers", "are the answers"):
        at = response.lower().rfind(marker)
        if at != -1:
            response = response[:at].strip()
    boxed = last_boxed(response)
    if boxed:
        response = boxed
    if ". " in response:
        at = response.lower().rfind(". ")
        if at != -1:
            response = response[:at].strip()
    for marker in (
        "be ",
        "is ",
        "are ",
        "=",
        ": ",
        "get ",
        "be\n",
        "is\n",
        "are\n",
        ":\n",
        "get\n",
    ):
        at = response.lower().rfind(marker)
        if at != -1:
            response = response[at + len(marker) :].strip()
    return response


def last_boxed(text: str) -> str | None:
    """The stripped contents of the last `\\boxed{...}` (else `\\fbox{...}`), braces balanced; None
    when there is none or it is never closed."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
    if start < 0:
        return None
    depth, opened = 0, None
    for at in range(start, len(text)):
        if text[at] == "{":
            depth += 1
            opened = at if opened is None else opened
        elif text[at] == "}":
            depth -= 1
            if depth == 0:
                return text[opened + 1 : at].strip()
    return None


# ---------------------------------------------------------------- PRM800K's grader


def grade_answer(given: str | None, expected: str) -> bool:
    """Equal after MATH's normalisation, or after PRM800K's (then element by element: unreduced
    fractions must match exactly, integers need an integer, the rest sympy simplifies to 0)."""
    if given is None:
        return False
    if normalize_answer(expected) == normalize_answer(given):
        return True
    expected_normal, given_normal = normalize_for_sympy(expected), normalize_for_sympy(given)
    if expected_normal == given_normal:
        return True
    if len(given_normal) == 0:
        return False
    expected_items, given_items = _tuple_items(expected_normal), _tuple_items(given_normal)
    if len(expected_items) > 1 and (
        expected_normal[0] != given_normal[0] or expected_normal[-1] != given_normal[-1]
    ):
        # (a, b) against [a, b]
        return False
    if len(expected_items) != len(given_items):
        return False
    return all(
        _items_equal(truth_item, answer_item)
        for truth_item, answer_item in zip(expected_items, given_items)
    )


def _items_equal(expected: str, given: str) -> bool:
    if _FRACTION.search(expected) and _FRACTION.search(given):
        # an unreduced fraction is not the answer
        return expected == given
    if _reads_as_integer(expected) != _reads_as_integer(given):
        return False
    return equal_under_sympy(expected, given)


def normalize_for_sympy(expr: str) -> str:
    """PRM800K's normalisation: `\\text{}`, dollars, percent, units and degrees dropped, `or`/`and`
    as commas, millions as powers of ten, LaTeX as plain text, mixed numbers as sums, lowercase."""
    wrapped = TEXT_WRAPPED.search(expr)
    if wrapped is not None:
        expr = wrapped.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = (
        expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    )
    for unit in _UNITS:
        expr = unit.sub("", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if len(expr) > 0 and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(",\\\\! *", "", expr)
    if _reads_as_float(expr) and _near_integer(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        try:
            expr = _latex_to_text(expr)
        # pylatexenc could not read it: the LaTeX stays
        except Exception:
            pass
    expr = re.sub("- *", "-", expr)
    # 7 3/4 -> 7+3/4
    expr = re.sub(r"([0-9]) +([0-9])", r"\1+\2", expr)
    expr = expr.lower()
    if _reads_as_integer(expr):
        # int() truncates, as verl's does
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _latex_to_text(expr: str) -> str:
    from pylatexenc import latex2text

    expr = (
        expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    )
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for symbol, word in _LATEX_SYMBOLS:
        expr = expr.replace(symbol, word)
    return expr.strip()


def _reads_as_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _near_integer(value: float) -> bool:
    try:
        return abs(value - int(round(value))) <= 1e-7
    # inf, nan
    except Exception:
        return False


def _reads_as_integer(text: str) -> bool:
    try:
        return _near_integer(float(strip_thousands_commas(text)))
    except Exception:
        return False


def strip_thousands_commas(expr: str) -> str:
    """`1,234,567` -> `1234567`, leaving tuple commas (`1,2`) alone."""
    while True:
        stripped = _THOUSANDS_COMMA.sub(r"\1\3\4", expr)
        if stripped == expr:
            return stripped
        expr = stripped


def _tuple_items(expr: str) -> list[str]:
    expr = strip_thousands_commas(expr)
    if len(expr) == 0:
        return []
    if (
        len(expr) > 2
        and expr[0] in _TUPLE_BRACKETS
        and expr[-1] in _TUPLE_BRACKETS
        and all(bracket not in expr[1:-1] for bracket in _TUPLE_BRACKETS)
    ):
        return [item.strip() for item in expr[1:-1].split(",")]
    return [expr]


def equal_under_sympy(expected: str, given: str) -> bool:
    """sympy.simplify((expected) - (given)) == 0, for expressions with at most two unknown letters
    and no power sympy may hang on; any failure is "not equal"."""
    from sympy import simplify
    from sympy.parsing import sympy_parser

    try:
        expr = f"({expected})-({given})"
        if not _sympy_may_try(expr) or _could_run_code_or_explode(expr):
            return False
        transformations = sympy_parser.standard_transformations + (
            sympy_parser.implicit_multiplication_application,
        )
        if (
            simplify(
                sympy_parser.parse_expr(expr.replace("^", "**"), transformations=transformations)
            )
            == 0
        ):
            return True
    except Exception:
        pass
    return False


def _sympy_may_try(expr: str) -> bool:
    letters = {char for char in expr.replace("sqrt", "").replace("frac", "") if char.isalpha()}
    if len(letters) > 2 or any(risky in expr for risky in _RISKY_POWERS):
        return False
    return all(pattern.search(expr) is None for pattern in _RISKY_POWER_PATTERNS)


def _could_run_code_or_explode(expr: str) -> bool:
    """keel's own guard, not verl's: parse_expr evals its input, and a quoted string reaches
    sympify, which parses and runs it as code; integer towers (9**9**9) and factorials of huge
    numbers run in C for minutes where no alarm can stop them (verl's 10 s limit scores them 0)."""
    if "'" in expr or '"' in expr or _LARGE_FACTORIAL.search(expr):
        return True
    for chain in _INTEGER_POWER_CHAIN.finditer(expr.replace("^", "**").replace(" ", "")):
        *bases, exponent = (int(number) for number in chain.group().split("**"))
        # a**b**c is a**(b**c)
        for base in reversed(bases):
            if power_too_large(base, exponent):
                return True
            exponent = base**exponent
    return False
