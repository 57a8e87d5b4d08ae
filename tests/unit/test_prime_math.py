"""keel's prime_math (verl's scorer for the numina_* data sources) gives verl 0.9.1's triple on
several hundred generated responses (right, equivalent, wrong and malformed answers, in the
wrappings models write) against ground truths in the forms numina data has, with verl's own
prime_math run beside it (tests/verl_shim.py). Answers verl would run as code are refused, and the
few places keel departs from verl on purpose are listed in KNOWN_DIFFERENCES with the reason."""

import pytest

from keel.rewards.verl.literals import NotALiteral, literal_value
from keel.rewards.verl.prime_math import compute_score

# ground truth -> answers a model might give: the same value written otherwise, and wrong ones
ANSWERS_BY_TRUTH = {
    "5": [
        "5",
        "5.0",
        "05",
        "+5",
        "6",
        "-5",
        "x = 5",
        "5 \\text{ cm}",
        "\\text{5}",
        "5^\\circ",
        "\\frac{10}{2}",
        "4.99999999",
        "five",
    ],
    "-3": ["-3", "- 3", "3", "-3.0", "\\left(-3\\right)", "-\\frac{6}{2}", "−3"],
    "\\frac{3}{4}": [
        "\\frac{3}{4}",
        "\\dfrac{3}{4}",
        "3/4",
        "0.75",
        "\\frac34",
        "\\tfrac{3}{4}",
        "6/8",
        "\\frac{6}{8}",
        "75\\%",
        "0.7500",
        ".75",
        "\\frac{4}{3}",
        "0.76",
    ],
    "0.75": ["0.75", "\\frac{3}{4}", "3/4", ".75", "75\\%", "75%", "0.7499", "0.8"],
    "12\\%": ["12\\%", "12%", "12", "0.12", "\\frac{12}{100}", "13\\%"],
    "45^\\circ": ["45^\\circ", "45", "45^{\\circ}", "45 degrees", "\\frac{\\pi}{4}", "135^\\circ"],
    "2\\sqrt{3}": [
        "2\\sqrt{3}",
        "2\\sqrt3",
        "\\sqrt{12}",
        "2*sqrt(3)",
        "3.4641",
        "2 \\sqrt{3}",
        "3\\sqrt{2}",
    ],
    "\\frac{\\sqrt{2}}{2}": [
        "\\frac{\\sqrt{2}}{2}",
        "\\frac{1}{\\sqrt{2}}",
        "\\sqrt{2}/2",
        "0.7071",
        "\\sqrt{0.5}",
        "\\frac{\\sqrt{3}}{2}",
    ],
    "3\\pi": [
        "3\\pi",
        "3 \\pi",
        "9.42",
        "9.4248",
        "\\pi \\cdot 3",
        "3pi",
        "3\\cdot\\pi",
        "2\\pi",
        "9.43",
    ],
    "\\frac{\\pi}{3}": [
        "\\frac{\\pi}{3}",
        "\\pi/3",
        "1.0472",
        "60^\\circ",
        "\\frac{1}{3}\\pi",
        "\\frac{\\pi}{6}",
    ],
    "(1, 2)": [
        "(1, 2)",
        "(1,2)",
        "[1, 2]",
        "(2, 1)",
        "(1.0, 2.0)",
        "x=1, y=2",
        "1, 2",
        "(1, 2, 3)",
        "Point(1, 2)",
        "\\left(1, 2\\right)",
    ],
    "(-\\infty, 3]": [
        "(-\\infty, 3]",
        "(-\\infty,3]",
        "Interval.Lopen(-oo, 3)",
        "x \\le 3",
        "(-\\infty, 3)",
        "[3, \\infty)",
    ],
    "[2, 5)": ["[2, 5)", "[2,5)", "Interval.Ropen(2, 5)", "(2, 5)", "[2, 5]", "2 \\le x < 5"],
    "x^2+2x+1": ["x^2+2x+1", "(x+1)^2", "x^{2}+2x+1", "x**2 + 2*x + 1", "x^2+2x+2", "1+2x+x^2"],
    "\\text{B}": ["\\text{B}", "B", "b", "(B)", "\\textbf{B}", "C", "\\text{(B)}"],
    "C": ["C", "\\text{C}", "(C)", "c", "D", "C: 12"],
    "1,000,000": [
        "1,000,000",
        "1000000",
        "10^6",
        "1 million",
        "1{,}000{,}000",
        "1000000.0",
        "999999",
    ],
    "1.5 \\times 10^{6}": [
        "1.5 \\times 10^{6}",
        "1500000",
        "1.5e6",
        "1.5 \\cdot 10^6",
        "1,500,000",
        "15 \\times 10^5",
    ],
    "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}": [
        "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}",
        "\\begin{pmatrix}1\\\\2\\end{pmatrix}",
        "[1, 2]",
        "[[1], [2]]",
        "Matrix([[1], [2]])",
        "(1, 2)",
        "[2, 1]",
        "Matrix([[1], [3]])",
    ],
    "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}": [
        "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}",
        "[[1, 2], [3, 4]]",
        "[[1,2],[3,4]]",
        "Matrix([[1, 2], [3, 4]])",
        "[[1, 2], [3, 5]]",
        "[x, y]",
    ],
    "\\{1, 2, 3\\}": [
        "\\{1, 2, 3\\}",
        "{1, 2, 3}",
        "1, 2, 3",
        "\\{1,2,3\\}",
        "\\{3, 2, 1\\}",
        "\\{1, 2\\}",
    ],
    "x = 2": ["x = 2", "2", "x=2", "y = 2", "3"],
    "2 \\text{ cm}": ["2 \\text{ cm}", "2", "2 cm", "2 centimeters", "20 mm"],
    "\\$12.50": ["\\$12.50", "12.50", "$12.5", "12.5", "\\$ 12.50", "13"],
    "a=2, b=3": ["a=2, b=3", "2, 3", "a = 2 and b = 3", "(2, 3)", "3, 2"],
    "\\pm 2": ["\\pm 2", "2, -2", "-2, 2", "\\pm2", "2"],
    "1010_2": ["1010_2", "1010", "10", "1010_{2}", "1011_2"],
    "-\\frac{1}{2}": [
        "-\\frac{1}{2}",
        "-1/2",
        "-0.5",
        "\\frac{-1}{2}",
        "\\frac{1}{2}",
        "- \\frac{1}{2}",
        "-.5",
    ],
    "e^{2}": ["e^{2}", "e^2", "7.389", "\\exp(2)", "e^3"],
    "2 + 3i": ["2 + 3i", "2+3i", "3i + 2", "2 - 3i", "(2, 3)"],
    "\\text{(A)}": ["\\text{(A)}", "A", "(A)", "\\textbf{(A)}", "B"],
    "7 \\frac{3}{4}": ["7 \\frac{3}{4}", "\\frac{31}{4}", "7.75", "7 3/4", "31/4", "7\\frac{3}{4}"],
    "3.14": ["3.14", "\\pi", "3.1416", "22/7", "3.15"],
    "6.28": ["2\\pi", "6.28", "6.2832", "\\pi \\cdot 2", "2 \\pi"],
    "1000": ["1000", "1{,}000", "1,000", "10^3", "1e3", "1 000", "1000.00", "999"],
    "2.5 \\times 10^{-3}": ["2.5 \\times 10^{-3}", "0.0025", "2.5e-3", "\\frac{1}{400}", "0.025"],
    "60": [
        "60",
        "60 minutes",
        "1 hour",
        "60 \\text{ seconds}",
        "60^\\circ",
        "60\\%",
        "\\$60",
        "61",
    ],
    "2": ["2", "\\sqrt{4}", "4/2", "2.0000001", "\\boxed{2}", "two", "2\\pi/\\pi", "1+1"],
}

WRAPPINGS = [
    "\\boxed{{{}}}",
    "We simplify and find that the value is \\boxed{{{}}}.",
    "The answer is {}.",
    "The answer is: {}",
    "Answer: {}",
    "so x = {}",
    "{} is the answer",
    "Step 1: set up.\nStep 2: solve.\nTherefore the final answer is $\\boxed{{{}}}$.",
    "Thus we get {}",
    "\\fbox{{{}}}",
    "{}",
    "Hence the result is $ {} $. Done",
    "First $\\boxed{{0}}$ was wrong; the correct one is \\boxed{{{}}}",
    "The answers are {}",
]

MALFORMED = [
    ("", "5"),
    (" ", "5"),
    ("\\boxed{", "5"),
    ("\\boxed{5", "5"),
    ("\\boxed{5}}", "5"),
    ("\\boxed}5{", "5"),
    ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}"),
    ("}}}{{{", "1"),
    ("\\boxed{}", "0"),
    ("\\boxed{ }", "0"),
    ("\\boxed{\\boxed{3}}", "3"),
    ("\\boxed{3} and \\boxed{4}", "4"),
    ("\\boxed{3} and \\boxed{4}", "3"),
    ("The answer is", "5"),
    ("answer:", "5"),
    ("=", "5"),
    ("is is is 5", "5"),
    ("5. 6. 7", "5"),
    ("x" * 20000 + "\\boxed{42}", "42"),
    ("The answer is 42. " * 500, "42"),
    ("\\boxed{" + "1" * 3000 + "}", "1"),
    ("\\boxed{" + "9" * 5000 + "}", "9" * 5000),
    ("\\boxed{" + "(" * 300 + "1" + ")" * 300 + "}", "1"),
    ("The answer is ½", "\\frac{1}{2}"),
    ("The answer is π", "\\pi"),
    ("\\boxed{∞}", "\\infty"),
    ("İİİ The answer is 7.", "7"),
    ("İİİİİİİİİ answer: 12 or so", "12"),
    ("ẞ is 3", "3"),
    ("答案是 \\boxed{5}", "5"),
    ("The answer is 🙂 5", "5"),
    ("\\boxed{٥}", "5"),
    ("The answer is ５", "5"),
    ("\x00\\boxed{1}", "1"),
    ("\\boxed{1\n2}", "12"),
    ("The answer is \n\n 8", "8"),
    ("the ANSWER IS 9", "9"),
    ("\\boxed{nan}", "nan"),
    ("\\boxed{inf}", "inf"),
    ("\\boxed{1e400}", "1e400"),
    ("\\boxed{1_000}", "1000"),
    ("\\boxed{_}", "1"),
    ("\\boxed{\\sqrt}", "2"),
    ("\\boxed{\\frac}", "2"),
    ("\\boxed{\\frac1}", "1"),
    ("\\boxed{3\\text{ m}\\text{ s}}", "3"),
    ("\\boxed{[1, 2}", "[1, 2]"),
    ("\\boxed{(1, 2]}", "(1, 2)"),
    ("\\boxed{[]}", "[]"),
    ("\\boxed{()}", "()"),
    ("\\boxed{Point(1, 2)}", ""),
    ("\\boxed{,}", ","),
    ("\\boxed{1,2,3,4,5}", "1,2,3,4,5"),
    ("\\boxed{[[1,2],[3,4]}", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}"),
    ("\\boxed{\\pi\\pi}", "9.86"),
    ("\\boxed{\\pi^2}", "9.8696"),
    ("\\boxed{2\\pi}", "\\pi"),
    ("\\boxed{[\\pi, 2]}", "[3.14, 2]"),
    ("\\boxed{(\\pi, 1)}", "(3.14159, 1)"),
    ("\\boxed{\\pi_2}", "3"),
    ("\\boxed{5'3\"}", "5'3\""),
    ("\\boxed{f'(2)}", "f'(2)"),
    ("\\boxed{2^{100}}", "2^{100}"),
    ("\\boxed{2^10}", "1024"),
    ("\\boxed{10!}", "3628800"),
    ("\\boxed{x^2}", "x**2"),
    ("\\boxed{2**3**2}", "512"),
]


def generated_cases(wrappings_per_answer: int = 4) -> list[tuple[str, str]]:
    """Each answer in `wrappings_per_answer` of the wrappings, rotating, so every wrapping meets
    every kind of answer without the full product's cost (verl forks a process per sympy
    comparison)."""
    pairs = [(answer, truth) for truth, answers in ANSWERS_BY_TRUTH.items() for answer in answers]
    step = len(WRAPPINGS) // wrappings_per_answer
    return [
        (WRAPPINGS[(index + step * turn) % len(WRAPPINGS)].format(answer), truth)
        for index, (answer, truth) in enumerate(pairs)
        for turn in range(wrappings_per_answer)
    ] + MALFORMED


# keel departs from verl on purpose only where verl runs the answer as Python code (eval, or sympy's
# parse_expr, which evals too), because a response could then run anything in the trainer. None of
# the generated cases is one of these; each entry here must still differ (the test below checks).
KNOWN_DIFFERENCES = {
    # verl eval()s `abs(-2)*1*3.14...` after substituting pi (a call); keel evaluates literal
    # arithmetic only, so the answer stays text, not 6.28
    ("\\boxed{abs(-2)*\\pi}", "6.28"): "keel makes no calls in an answer it evaluates",
    # verl's sympy path parses re('1/2'), and sympify turns the quoted text into code (the way an
    # octal-escaped string reaches __import__); keel hands sympy no quoted text
    ("\\boxed{re('1/2')}", "\\frac{1}{2}"): "keel gives sympy no string to run",
    # verl's parse_expr runs `Matrix(...)` answers whole; keel only literal matrices (no attributes)
    (
        "\\boxed{Matrix([[x.subs(x, 2)]])}",
        "\\begin{pmatrix} 2 \\end{pmatrix}",
    ): "keel parses literal matrices only",
}
# Not compared here: verl bounds each sympy comparison at 10 s (a forked process) and scores one
# past it 0, where keel runs on under reward.timeout_s (see keel/rewards/verl/prime_math.py); verl's
# eval has no bound at all (`\boxed{9**9**9\pi}` never returns), where keel refuses values too large
# to build; and when both the answer and the ground truth nest brackets more than about 230 deep,
# keel's comparison runs out of Python's recursion limit before verl's (four frames a level against
# two) and calls wrong what verl may call right. No ground truth nests like that.


@pytest.fixture(scope="module")
def verl_prime_math():
    from verl_shim import verl_module

    return verl_module("verl.utils.reward_score.prime_math")


def test_the_cases_are_many_and_varied():
    cases = generated_cases()
    assert len(cases) > 500 and len(set(cases)) > 500
    scores = [compute_score(response, truth)[0] for response, truth in cases[::7]]
    # right and wrong answers both well represented
    assert 0.2 < sum(scores) / len(scores) < 0.8


def test_keel_scores_as_verl_does(verl_prime_math):
    differences = []
    for response, truth in generated_cases():
        keel, verl = compute_score(response, truth), verl_prime_math.compute_score(response, truth)
        if keel != verl or type(keel[0]) is not type(verl[0]):
            differences.append((response[:80], truth[:40], keel, verl))
    assert differences == []


@pytest.mark.parametrize("response, truth", list(KNOWN_DIFFERENCES))
def test_known_differences_are_still_differences(verl_prime_math, response, truth):
    assert compute_score(response, truth) != verl_prime_math.compute_score(response, truth)


def test_a_few_scores_by_hand():
    assert compute_score("The answer is \\boxed{\\frac{1}{2}}", "0.5") == (
        True,
        True,
        "\\frac{1}{2}",
    )
    assert compute_score("Step 1: x.\nStep 2: y.\n\\boxed{7}", "8") == (False, True, "7")
    # an unreduced fraction is not the answer
    assert compute_score("so x = 6/8", "\\frac{3}{4}")[0] is False
    # pi as 3.14 too
    assert compute_score("\\boxed{2\\pi}", "6.28")[0] is True
    # a list against a pmatrix
    assert compute_score("\\boxed{[1]}", "\\begin{pmatrix} 1 \\end{pmatrix}")[0] is True
    # verl splits the pmatrix at each backslash, so the `\\` between rows makes an empty row: never
    # equal
    assert (
        compute_score(
            "\\boxed{[[1, 2], [3, 4]]}", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}"
        )[0]
        is False
    )


def octal_escaped(code: str) -> str:
    """A Python string literal of `code` with no letters in it, the way past verl's letter count."""
    return "'" + "".join(f"\\textbackslash{{}}{ord(char):o}" for char in code) + "'"


@pytest.mark.parametrize(
    "answer, truth",
    [
        ("re({payload})", "\\frac{1}{2}"),
        ("im({payload})", "x+1"),
        ("id({payload})", "x"),
        ("__import__('pathlib').Path('{marker}').touch() or \\pi", "3.14"),
        ("[__import__('pathlib').Path('{marker}').touch()]", "\\begin{pmatrix} 1 \\end{pmatrix}"),
        (
            "Matrix([[__import__('pathlib').Path('{marker}').touch()]])",
            "\\begin{pmatrix} 1 \\end{pmatrix}",
        ),
        ("Matrix([[1]]).__class__.__init__.__globals__", "\\begin{pmatrix} 1 \\end{pmatrix}"),
    ],
)
def test_an_answer_cannot_run_code(tmp_path, answer, truth):
    """verl 0.9.1 runs each of these (sympy's parse_expr turns the quoted string into code through
    sympify; the \\pi and matrix branches eval the answer). keel must score them without running
    them."""
    marker = tmp_path / "ran"
    payload = octal_escaped(f"__import__('pathlib').Path('{marker}').touch()")
    response = (
        "The answer is \\boxed{"
        + answer.replace("{payload}", payload).replace("{marker}", str(marker))
        + "}"
    )
    correct, _, _ = compute_score(response, truth)
    assert not marker.exists()
    assert correct is False


@pytest.mark.parametrize(
    "answer, truth",
    [
        ("9**9**9", "\\frac{1}{3}"),
        ("(9^9)^{9^9}", "\\frac{1}{3}"),
        ("99999999!", "\\frac{1}{3}"),
        ("9**9**9\\pi", "3.14"),
        ("[9**9**9]", "\\begin{pmatrix} 1 \\end{pmatrix}"),
    ],
)
def test_an_answer_too_large_to_compute_is_wrong(answer, truth):
    """verl gives these 0 after its 10 s limit (or hangs, where eval has no limit); keel refuses
    them at once."""
    assert compute_score("\\boxed{" + answer + "}", truth)[0] is False


@pytest.mark.parametrize(
    "text",
    [
        "1*3.141592653589793",
        "2*3.14/4",
        "-(1*3.14)**2",
        "(1, 2*3.14)",
        "[1, [2, 3]]",
        "{1, 2}",
        "{1: 2}",
        "1e5*3.14",
        "7 // 2 % 3",
        "2 ^ 3",
        "1 < 2*3.14 <= 7",
        "0 or 1*3.14",
        "1 and 0",
        "'a' * 3",
        " \t1",
        "3j*3.14",
        "not 0",
        "~5",
        "5 << 3",
    ],
)
def test_literal_value_is_what_eval_returns(text):
    assert literal_value(text) == eval(text)  # noqa: S307 - the texts are the test's own


@pytest.mark.parametrize(
    "text",
    [
        "x*3.14",
        "abs(-2)",
        "(1).real",
        "[1][0]",
        "__import__('os')",
        "lambda: 1",
        "9**9**9",
        "'%099999999d' % 1",
        "[0] * 10**9",
        "1 << 10**9",
        "f'{1}'",
    ],
)
def test_literal_value_refuses_code_and_giants(text):
    with pytest.raises((NotALiteral, SyntaxError)):
        literal_value(text)


def test_the_attack_works_on_verl_itself_so_the_guard_is_needed(tmp_path, verl_prime_math):
    """The same octal-escaped string runs in verl 0.9.1 (this is why keel departs from it there)."""
    marker = tmp_path / "ran"
    payload = octal_escaped(f"__import__('pathlib').Path('{marker}').touch()")
    verl_prime_math.compute_score("\\boxed{re(" + payload + ")}", "\\frac{1}{2}")
    assert marker.exists()
