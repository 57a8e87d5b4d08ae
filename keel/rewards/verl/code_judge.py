"""One code test's verdict, as verl's prime_code gives it: what a program printed or returned (as
keel's jail reports it) compared with the expected output by verl's rules."""

from __future__ import annotations

import json
from typing import Any


def _clip(text: str, length: int) -> str:
    """verl's metadata shortening: the two ends of a long text."""
    return (
        text
        if len(text) <= length
        else text[: length // 2] + "...(truncated) ..." + text[-length // 2 :]
    )


def _decoded(value: Any) -> Any:
    """The harness's encoding of a returned value back to Python: tuples, lists, dicts with their
    keys."""
    if not isinstance(value, dict):
        return value
    ((kind, items),) = value.items()
    if kind == "dict":
        return {_decoded(key): _decoded(item) for key, item in items}
    return (tuple if kind == "tuple" else list)(_decoded(item) for item in items)


def _expected_return(raw: Any) -> Any:
    """verl's reading of a call-style expected output: JSON, dict keys made ints (and wrapped in a
    list)."""
    expected = json.loads(raw)
    if isinstance(expected, dict):
        try:
            expected = [{int(key): item for key, item in expected.items()}]
        except (TypeError, ValueError):
            pass
    try:
        if isinstance(expected[0], dict):
            expected = [{int(key): item for key, item in expected[0].items()}]
    except (TypeError, ValueError, KeyError, IndexError):
        pass
    return expected


def return_matches(output: Any, expected: Any) -> bool:
    """verl's rule: equal, or equal to the expected list's first item; a returned tuple (or a list
    of tuples) compared as lists."""
    if isinstance(output, tuple):
        output = list(output)
    matched = output == expected or (
        isinstance(expected, list) and bool(expected) and output == expected[0]
    )
    try:
        if isinstance(output[0], tuple):
            matched = matched or [list(item) for item in output] == expected[0]
    # outputs that cannot be indexed so, as verl skips them
    except Exception:
        pass
    return matched is True


def _digits(text: str) -> bool:
    return text.isdigit()


def printed_matches(printed: str, expected: str) -> bool:
    """verl's rule for stdin programs: the whole text equal with surrounding whitespace ignored
    (each line stripped or not); else the lines equal to the expected lines stripped, blank ones
    dropped; else, unless every line is a whole number, the lines as numbers within numpy's
    allclose."""
    import numpy as np

    lines = printed.splitlines()
    if (
        "\n".join(lines).strip() == expected.strip()
        or "\n".join(line.strip() for line in lines).strip() == expected.strip()
    ):
        return True
    wanted = [line.strip() for line in expected.split("\n") if line]
    kept = [line for line in lines if line]
    if lines == wanted or kept == wanted:
        return True
    if len(kept) != len(wanted) or all(_digits(a) and _digits(b) for a, b in zip(kept, wanted)):
        return False
    try:
        return bool(np.allclose([float(line) for line in kept], [float(line) for line in wanted]))
    except (ValueError, OverflowError):
        return False


def judge(report: dict, given: Any, wanted: Any, fn_name: str | None) -> tuple[bool | int, dict]:
    """One test's result as verl writes it (True, False, -1 for a failure, -2 for a compile error)
    and its metadata."""
    kind = report.get("kind")
    if kind == "compile":
        return -2, {"error": report.get("error"), "traceback": report.get("traceback")}
    if kind == "error":
        return -1, {"error": report.get("error"), "traceback": report.get("traceback")}
    try:
        if kind == "ran" and fn_name is None:
            shown, passed = (
                _clip(str(report["printed"]), 200),
                printed_matches(str(report["printed"]), wanted),
            )
            inputs = _clip(given, 300)
        elif kind == "returned" and fn_name is not None:
            shown = _clip(str(report.get("shown")), 200)
            passed = return_matches(_decoded(report["value"]), _expected_return(wanted))
            size = 300 // (given.count("\n") + 1)
            inputs = "\n".join(_clip(line, size) for line in given.strip().split("\n"))
        # timed out, died, or data verl cannot run
        else:
            return -1, {}
    # a report or an expected output that does not read
    except (ValueError, TypeError, KeyError, RecursionError):
        return -1, {}
    if passed:
        return True, {}
    return False, {
        "output": shown,
        "expected": _clip(str(wanted), 200),
        "inputs": inputs,
        "error_message": "Wrong Answer",
    }
