"""The comparisons behind verl 0.9.1's `prime_math` scorer, in keel's own code: the MATH data set's
string normalisation (`normalize_answer`) and ToRA's `math_equal` (numbers, percentages, tuples,
intervals, matrices), plus `literal_value`, keel's stand-in for the `eval()` verl runs on the
model's answer.

The rules follow verl's to the character, because a verl user's reward curve must not move when
the trainer changes. Where verl runs model-written text as Python (`eval` after substituting
`\\pi`, `eval` and sympy's `parse_expr` on matrix answers), keel evaluates literal arithmetic only,
so a response cannot run code in the trainer; anything else counts as "did not evaluate", as a
Python error does in verl.
"""

from __future__ import annotations

import ast
import math
import operator
import re
import warnings
from math import isclose

# The MATH set's brace and slash rules, shared with verl's math_reward rule (the same in both of verl's copies).
from keel.rewards.verl_math import braced_frac_arguments, braced_sqrt_arguments, slash_as_frac

TEXT_WRAPPED = re.compile(r"^\\text\{(?P<text>.+?)\}$")  # an answer that is all `\text{...}`

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
    except Exception:  # verl's rule: any failure leaves the answer as it is
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
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 3" -> "3"
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
        raise ValueError("more than one unit")  # verl asserts here: the whole normalisation is dropped
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
    prediction, reference, include_percentage: bool = True, tolerance: float = 1e-4, pi: float = math.pi
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
    if isinstance(answer, str) and "_" in answer:  # `1010_2`: the digits before the base (may raise)
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
    except Exception:  # verl: eval() failed, the text stays
        return answer


def _as_number(value) -> tuple[bool, float | None]:
    """(True, number) when the text reads as a number once thousands commas (`{,}` or `,`) go."""
    try:
        text = str(value)
        return True, float(text.replace("{,}", "") if "{,}" in text else text.replace(",", ""))
    except ValueError:
        return False, None


def _numeric_verdict(prediction, reference, include_percentage: bool, tolerance: float) -> bool | None:
    """Equal within `tolerance` (the reference also read as a percentage either way) when both are
    numbers; None when they are not both numbers."""
    try:
        if not (_as_number(prediction)[0] and _as_number(reference)[0]):
            return None
        predicted, expected = _as_number(prediction)[1], _as_number(reference)[1]
        candidates = [expected / 100, expected, expected * 100] if include_percentage else [expected]
        return any(isclose(candidate, predicted, rel_tol=tolerance) for candidate in candidates)
    except Exception:
        return None


def _structural_equal(prediction: str, reference: str, include_percentage: bool, tolerance: float) -> bool:
    """Brackets ignored, then part by part: intervals and tuples, comma lists, `Point(...)`, matrices."""
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
        if _parts_equal(prediction[1:-1].split(","), reference[1:-1].split(","), include_percentage, tolerance):
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


def _parts_equal(predicted: list, expected: list, include_percentage: bool, tolerance: float) -> bool:
    """Same length and pairwise equal. Every pair is compared (a list, not a generator), so an error
    in any pair propagates as it does in verl. Nested comparisons use the default pi, as verl's do."""
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
    if (prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")) or (
        prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("[")
    ):
        prediction, reference = prediction.strip("[]()"), reference.strip("[]()")
    for bracket in "{}()":
        prediction, reference = prediction.replace(bracket, ""), reference.replace(bracket, "")
    return prediction == reference


def _sympy_matrix_equal(prediction: str, reference: str, include_percentage: bool, tolerance: float) -> bool:
    """`Matrix([[1], [2]])` against `\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}`, entry by entry."""
    try:
        entries = parse_literal_matrix(prediction)
        expected = reference.split()[1:-1:2]
        return len(entries) == len(expected) and all(
            [math_equal(entry, item, include_percentage, tolerance) for item, entry in zip(expected, entries)]
        )
    except Exception:  # verl: a failed parse or comparison is "not equal"
        return False


def _list_matrix_equal(prediction: str, reference: str, include_percentage: bool, tolerance: float) -> bool:
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
            [math_equal(row_p, row, include_percentage, tolerance) for row, row_p in zip(rows, rows_predicted)]
        )
    except Exception:
        return False


# ---------------------------------------------------------------- literal evaluation

# verl calls eval() on the model's answer; keel computes the same value for literal arithmetic
# (numbers, strings, tuples, lists, sets, dicts, operators, comparisons, and/or) and raises on
# anything else: names, calls, attributes. Results too large to build in reasonable time
# (9**9**9) raise as well, where verl's eval would run until the scorer is killed.
LARGEST_RESULT_BITS = 1 << 22
LONGEST_SEQUENCE = 1 << 20
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.LShift: operator.lshift,
    ast.RShift: operator.rshift,
    ast.BitOr: operator.or_,
    ast.BitXor: operator.xor,
    ast.BitAnd: operator.and_,
    ast.MatMult: operator.matmul,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Not: operator.not_, ast.Invert: operator.invert}
_COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_CONTAINERS = {ast.Tuple: tuple, ast.List: list, ast.Set: set}


class NotALiteral(ValueError):
    """The text is not literal arithmetic keel evaluates (verl's eval would run it as code), or its
    value would be unreasonably large."""


def literal_value(text: str):
    """What Python's eval(text) returns, for literal arithmetic only (eval skips leading blanks)."""
    with warnings.catch_warnings():  # `2x`, `1is 2`: the parser's warnings about model text are noise
        warnings.simplefilter("ignore", SyntaxWarning)
        tree = ast.parse(text.lstrip(" \t"), mode="eval")
    return _evaluate(tree.body)


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Constant):
        return node.value
    if type(node) in _CONTAINERS:
        return _CONTAINERS[type(node)](_evaluate(item) for item in node.elts)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_evaluate(key): _evaluate(value) for key, value in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        _refuse_huge(node.op, left, right)
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
        left = _evaluate(node.left)
        for op, comparator in zip(node.ops, node.comparators):  # chained, stopping at the first False
            right = _evaluate(comparator)
            verdict = _COMPARE[type(op)](left, right)
            if not verdict:
                return verdict
            left = right
        return verdict
    if isinstance(node, ast.BoolOp):
        value = _evaluate(node.values[0])
        for operand in node.values[1:]:
            if bool(value) != isinstance(node.op, ast.And):  # `and` stops at a falsy value, `or` at a truthy one
                return value
            value = _evaluate(operand)
        return value
    raise NotALiteral(f"not literal arithmetic: {type(node).__name__}")


def _refuse_huge(op: ast.operator, left, right) -> None:
    sequences = (str, bytes, list, tuple)
    if isinstance(op, ast.Pow) and isinstance(left, int) and isinstance(right, int):
        if power_too_large(left, right):
            raise NotALiteral("power too large")
    elif isinstance(op, ast.LShift) and isinstance(left, int) and isinstance(right, int):
        if left and right > LARGEST_RESULT_BITS:
            raise NotALiteral("shift too large")
    elif isinstance(op, ast.Mult):
        for sequence, count in ((left, right), (right, left)):
            if isinstance(sequence, sequences) and isinstance(count, int) and len(sequence) * count > LONGEST_SEQUENCE:
                raise NotALiteral("repetition too long")
    elif isinstance(op, ast.Mod) and isinstance(left, (str, bytes)):
        raise NotALiteral("string formatting")  # '%0999999999d' % 1 builds a gigabyte


def power_too_large(base: int, exponent: int) -> bool:
    """base**exponent past LARGEST_RESULT_BITS: sympy would compute it for minutes, uninterruptibly."""
    return exponent > 0 and abs(base) > 1 and exponent * abs(base).bit_length() > LARGEST_RESULT_BITS


# sympy's parse_expr (which verl runs on `Matrix...` answers) is eval underneath; keel hands it
# only a Matrix of literal entries: numbers, names (which become symbols), arithmetic with small
# powers, and a few of sympy's functions.
_MATRIX_NODES = (
    ast.Expression,
    ast.Call,
    ast.List,
    ast.Tuple,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.UnaryOp,
    ast.BinOp,
    ast.operator,
    ast.unaryop,
)
_MATRIX_CALLS = {"Matrix", "sqrt", "Rational", "Abs", "exp", "log", "sin", "cos", "tan"}


def parse_literal_matrix(text: str):
    """sympy's parse_expr(text) for a `Matrix(...)` of literal entries; NotALiteral otherwise."""
    from sympy.parsing.sympy_parser import parse_expr

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        tree = ast.parse(text, mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, _MATRIX_NODES) or (
            isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, complex))
        ):
            raise NotALiteral(f"not a literal matrix: {type(node).__name__}")
        if isinstance(node, ast.Call) and (
            node.keywords or not isinstance(node.func, ast.Name) or node.func.id not in _MATRIX_CALLS
        ):
            raise NotALiteral("a call keel does not make")
        if isinstance(node, (ast.BinOp, ast.UnaryOp)) and _list_operand(node):
            raise NotALiteral("arithmetic on a list")  # [0]*10**9
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and not _small_power(node):
            raise NotALiteral("a power too large")
    return parse_expr(text)


def _list_operand(node: ast.AST) -> bool:
    """A list or tuple taken as an operand (Matrix(...)'s own arguments are not operands)."""
    operands = [node.left, node.right] if isinstance(node, ast.BinOp) else [node.operand]
    return any(
        isinstance(operand, (ast.List, ast.Tuple))
        or (isinstance(operand, (ast.BinOp, ast.UnaryOp)) and _list_operand(operand))
        for operand in operands
    )


def _small_power(node: ast.BinOp) -> bool:
    """A power sympy computes at once: a base with no power in it, a numeric exponent up to 10,000."""
    if any(isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Pow) for inner in ast.walk(node.left)):
        return False
    try:
        exponent = _evaluate(node.right)
    except Exception:  # a symbol in the exponent (it could cancel to anything)
        return False
    return isinstance(exponent, (int, float, complex)) and abs(exponent) <= 10_000
