"""verl 0.9.1's math rules, reimplemented so that keel scores as verl does on the same inputs.

Three rules, named as keel's scorers (see keel/rewards/verl/routing.py for the data sources each
serves):

- `math_reward`: verl's `math_reward.py`, the MATH benchmark's string normalisation (Hendrycks et
  al.,
  as in lm-evaluation-harness): the last `\\boxed{...}` must equal the ground truth once both are
  normalised (`\\dfrac12` = `\\frac{1}{2}`, `0.5` = `\\frac{1}{2}`, `x = 3` = `3`); 1.0 or 0.0.
- `math_dapo`: verl's `math_dapo.py` (DAPO's rule, Minerva's normalisation): the last `Answer: x`
  line in
  the last 300 characters, else a `\\boxed{x}` in the last 100 that equals the ground truth as
  written; +1 or -1, returned as verl's dict `{score, acc, pred}`.
- `geo3k`: verl's `geo3k.py`: mathruler's grader on the boxed answer (0.9) plus a format part (0.1)
  for
  `<think>...</think> ... \\boxed{...}`.

The quirks are verl's and kept on purpose (reward curves must compare): `math_reward` never scores
`\\fbox{}`, `math_dapo` compares a boxed answer with the ground truth unnormalised, and so on. Each
is pinned against verl's own code by tests/unit/test_verl_scores.py.
"""

from __future__ import annotations

import re
from typing import Any

# --------------------------------------------------------------------------------------------------
# math_reward: the MATH benchmark's normalisation


class _NotNormalisable(Exception):
    """The MATH normalisation has no answer for this string (verl's code raises there); the raw
    strings are then compared."""


def _last_boxed_for_math_reward(text: str) -> str | None:
    """The content of the last box as verl's math_reward reads it, or None when it reads none.

    A `\\boxed ` with a space anywhere wins: the text after its last occurrence, up to a `$`.
    Otherwise the last `\\boxed` (or, without one, `\\fbox`) up to the brace that closes its first
    group; only a `\\boxed{` opened right there yields an answer (so `\\fbox{1}` and
    `\\boxed\\frac{1}{2}` yield none)."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for end in range(start, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                box = text[start : end + 1]
                return box[len("\\boxed{") : -1] if box.startswith("\\boxed{") else None
    return None


def braced_sqrt_arguments(text: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}`: a one-character argument gets its braces."""
    head, *rest = text.split("\\sqrt")
    pieces = [head]
    for piece in rest:
        if not piece:
            raise _NotNormalisable("\\sqrt without an argument")
        pieces.append("\\sqrt" + (piece if piece[0] == "{" else "{" + piece[0] + "}" + piece[1:]))
    return "".join(pieces)


def braced_frac_arguments(text: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{72}` -> `\\frac{1}{72}`; a `\\frac` followed by fewer
    than two characters leaves the whole text as it was."""
    head, *rest = text.split("\\frac")
    pieces = [head]
    for piece in rest:
        if not piece:
            raise _NotNormalisable("\\frac without arguments")
        if piece[0] == "{":
            pieces.append("\\frac" + piece)
        elif len(piece) < 2:
            return text
        elif piece[1] == "{":
            pieces.append("\\frac{" + piece[0] + "}" + piece[1:])
        else:
            pieces.append("\\frac{" + piece[0] + "}{" + piece[1] + "}" + piece[2:])
    return "".join(pieces)


def slash_as_frac(text: str) -> str:
    """`3/4` -> `\\frac{3}{4}` when both sides are plain integers written as Python writes them."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    if text != f"{numerator}/{denominator}":
        return text
    return f"\\frac{{{numerator}}}{{{denominator}}}"


_MATH_DROPPED = ("\n", "\\!")
_MATH_RENAMED = (("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"))
_MATH_DROPPED_AFTER = ("\\left", "\\right", "^{\\circ}", "^\\circ", "\\$")
_MATH_PERCENT = ("\\\\%", "\\%")


def _normalise_math_answer(text: str) -> str:
    """The MATH benchmark's canonical form of an answer string (raises _NotNormalisable)."""
    for dropped in _MATH_DROPPED:
        text = text.replace(dropped, "")
    for old, new in _MATH_RENAMED:
        text = text.replace(old, new)
    for dropped in _MATH_DROPPED_AFTER:
        text = text.replace(dropped, "")
    # units written on the right, "5 \\text{ cm}"
    if "\\text{ " in text:
        value_and_units = text.split("\\text{ ")
        if len(value_and_units) != 2:
            raise _NotNormalisable("more than one \\text{ ")
        text = value_and_units[0]
    for dropped in _MATH_PERCENT:
        text = text.replace(dropped, "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    # "x = 3", "k=3": the value
    if len(sides) == 2 and len(sides[0]) <= 2:
        text = sides[1]
    text = braced_sqrt_arguments(text).replace(" ", "")
    text = braced_frac_arguments(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return slash_as_frac(text)


def math_answers_equal(answer: str, ground_truth: Any) -> bool:
    """Whether two answers are the same after the MATH normalisation; raw equality where it has
    none."""
    if not isinstance(ground_truth, str):
        # verl falls back to comparing the objects: a string is never a number
        return answer == ground_truth
    try:
        return _normalise_math_answer(answer) == _normalise_math_answer(ground_truth)
    except _NotNormalisable:
        return answer == ground_truth


def math_reward(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """verl's `math_reward` rule: 1.0 when the last `\\boxed{}` equals the ground truth after the
    MATH benchmark's normalisation, else 0.0."""
    answer = _last_boxed_for_math_reward(solution_str)
    return float(
        answer is not None and ground_truth is not None and math_answers_equal(answer, ground_truth)
    )


# --------------------------------------------------------------------------------------------------
# math_dapo: Minerva's normalisation, `Answer:` lines first

# verl's `pred` when no `Answer:` line is found
NO_ANSWER = "[INVALID]"
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
# verl reads only the end of a response...
DAPO_CLIP_CHARS = 300
# ...and looks for a box in the end of that
DAPO_BOX_CLIP_CHARS = 100

# Minerva's replacements, in order: spaces and articles go first, then units and TeX decorations.
_MINERVA_REPLACED = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    (r"\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_MINERVA_UNITS_AND_DECORATIONS = (
    "square ways integers dollars mph inches hours km units \\ldots sue points feet minutes "
    "digits cents degrees cm gm pounds meters meals edges students childrentickets multiples "
    "\\text{s} \\text{.}"
).split() + [
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    r"\mathrm{th}",
    r"^\circ",
    r"^{\circ}",
    r"\;",
    r",\!",
    "{,}",
    '"',
    "\\dots",
]
_FIRST_DOLLAR_PAIR = re.compile(r"(.*?)(\$)(.*?)(\$)(.*)")
_UNWRAPPED = [
    re.compile(r"(\\text\{)(.*?)(\})"),
    re.compile(r"(\\textbf\{)(.*?)(\})"),
    re.compile(r"(\\overline\{)(.*?)(\})"),
    re.compile(r"(\\boxed\{)(.*)(\})"),
]
_SHORT_FRAC = re.compile(r"(frac)([^{])(.)")
_SHORT_SQRT = re.compile(r"(sqrt)([^{])")


def normalise_minerva_answer(answer: str) -> str:
    """Minerva's canonical form of a final answer: the value after the last `=`, without units,
    spaces, `$` and TeX wrappers, shorthand `\\frac12` braced, `1,000` -> `1000`."""
    answer = answer.split("=")[-1]
    for old, new in _MINERVA_REPLACED:
        answer = answer.replace(old, new)
    for dropped in _MINERVA_UNITS_AND_DECORATIONS:
        answer = answer.replace(dropped, "")
    answer = _FIRST_DOLLAR_PAIR.sub(r"$\3$", answer)
    for wrapper in _UNWRAPPED:
        answer = wrapper.sub(r"\2", answer)
    answer = _SHORT_FRAC.sub(r"frac{\2}{\3}", answer)
    answer = _SHORT_SQRT.sub(r"sqrt{\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def _last_boxed_for_dapo(text: str) -> str | None:
    """The content of the last `\\boxed{` whose braces close, else None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for end in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if text[end] == "}" and depth == 0:
            return text[start + len("\\boxed{") : end]
    return None


def dapo_judgement(solution_str: str, ground_truth: str) -> tuple[bool, str | None]:
    """(correct, the answer read) as verl's math_dapo judges it, without strict_box_verify."""
    tail = solution_str[-DAPO_CLIP_CHARS:]
    lines = _ANSWER_LINE.findall(tail)
    predicted = normalise_minerva_answer(lines[-1] if lines else NO_ANSWER)
    # raises on a non-string ground truth, as verl does
    truth = normalise_minerva_answer(ground_truth)
    if predicted != NO_ANSWER:
        return predicted == truth, predicted
    boxed = _last_boxed_for_dapo(tail[-DAPO_BOX_CLIP_CHARS:])
    if boxed is not None:
        return boxed == ground_truth, boxed
    return predicted == truth, predicted


def math_dapo(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> dict:
    """verl's `math_dapo` rule: {"score": 1.0 or -1.0, "acc": bool, "pred": the answer read}."""
    if not isinstance(ground_truth, str):
        raise TypeError(
            f"math_dapo compares with a string ground truth; got {type(ground_truth).__name__} "
            f'{ground_truth!r} (write reward_model.ground_truth as a string, e.g. "72")'
        )
    correct, predicted = dapo_judgement(solution_str, ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": predicted}


# --------------------------------------------------------------------------------------------------
# geo3k: mathruler's grader

GEO3K_FORMAT_WEIGHT = 0.1
_GEO3K_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def geo3k(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """verl's `geo3k` rule: 0.9 when mathruler grades the last boxed answer equal to the ground
    truth, plus 0.1 when the response is `<think>...</think>` followed by a `\\boxed{...}`."""
    from mathruler.grader import extract_boxed_content, grade_answer

    accurate = 1.0 if grade_answer(extract_boxed_content(solution_str), ground_truth) else 0.0
    well_formed = 1.0 if _GEO3K_FORMAT.fullmatch(solution_str) else 0.0
    return (1.0 - GEO3K_FORMAT_WEIGHT) * accurate + GEO3K_FORMAT_WEIGHT * well_formed
