"""keel's stand-in for the `eval()` (and sympy's `parse_expr`) verl's prime_math scorer runs on the
model's answer: the same value for literal arithmetic, NotALiteral for anything else, so a
response cannot run code in the trainer (keel.rewards.verl.prime_math_compare compares the
values)."""

from __future__ import annotations

import ast
import operator
import warnings

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
_UNARY = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
    ast.Not: operator.not_,
    ast.Invert: operator.invert,
}
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
    # `2x`, `1is 2`: the parser's warnings about model text are noise
    with warnings.catch_warnings():
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
        # chained, stopping at the first False
        for op, comparator in zip(node.ops, node.comparators):
            right = _evaluate(comparator)
            verdict = _COMPARE[type(op)](left, right)
            if not verdict:
                return verdict
            left = right
        return verdict
    if isinstance(node, ast.BoolOp):
        value = _evaluate(node.values[0])
        for operand in node.values[1:]:
            # `and` stops at a falsy value, `or` at a truthy one
            if bool(value) != isinstance(node.op, ast.And):
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
            if (
                isinstance(sequence, sequences)
                and isinstance(count, int)
                and len(sequence) * count > LONGEST_SEQUENCE
            ):
                raise NotALiteral("repetition too long")
    elif isinstance(op, ast.Mod) and isinstance(left, (str, bytes)):
        # '%0999999999d' % 1 builds a gigabyte
        raise NotALiteral("string formatting")


def power_too_large(base: int, exponent: int) -> bool:
    """base**exponent past LARGEST_RESULT_BITS: sympy would compute it for minutes,
    uninterruptibly."""
    return (
        exponent > 0 and abs(base) > 1 and exponent * abs(base).bit_length() > LARGEST_RESULT_BITS
    )


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
            node.keywords
            or not isinstance(node.func, ast.Name)
            or node.func.id not in _MATRIX_CALLS
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
    """A power sympy computes at once: a base with no power in it, a numeric exponent up to
    10,000."""
    if any(
        isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Pow)
        for inner in ast.walk(node.left)
    ):
        return False
    try:
        exponent = _evaluate(node.right)
    # a symbol in the exponent (it could cancel to anything)
    except Exception:
        return False
    return isinstance(exponent, (int, float, complex)) and abs(exponent) <= 10_000
