"""verl's code data scores in keel's jail as verl's own prime_code scores it: the same programs on
the same rows, scored by both (verl's in this process, as verl runs it; keel's in the jail)."""

import json
from types import SimpleNamespace

import pytest

from keel.errors import KeelError
from keel.rewards.jail.sandbox import Limits, run_python
from keel.rewards.verl.code_tests import check_ground_truths, code_exec, compute_score, prime_code

from verl_shim import verl_module

# verl's 5 s and 10 s per test, shortened on both sides so an endless loop ends soon
TIMEOUT_S = 2
ADD = json.dumps({"inputs": ["1 2\n", "3 4\n", "10 -4\n"], "outputs": ["3\n", "7\n", "6\n"]})
THIRD = json.dumps({"inputs": ["1\n", "2\n"], "outputs": ["0.3333333\n", "0.6666667\n"]})
ELEVEN = json.dumps(
    {"inputs": [f"{i}\n" for i in range(11)], "outputs": [f"{i}\n" for i in range(10)] + ["wrong"]}
)
CALL = json.dumps(
    {
        "fn_name": "pair",
        "inputs": ["1\n2", "[3]\n4", "5\n6"],
        "outputs": ["[1, 2]", "[[3], 4]", "[[5, 6]]"],
    }
)

READ_ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
STDIN_PROGRAMS = {
    "correct, in a fence after prose": f"Read both numbers.\n```python\n{READ_ADD}```\nDone.",
    "no code block": READ_ADD,
    "prose without a code block": "The sum of the two numbers, printed.",
    "a fence without the python tag": f"```\n{READ_ADD}```",
    "wrong on a negative number": "a, b = map(int, input().split())\nprint(abs(a) + abs(b))",
    "crashes on a negative number": "a, b = map(int, input().split())\nassert b > 0\nprint(a + b)",
    "always crashes": "print(1 // 0)",
    "syntax error": "print(1 +\n",
    "endless loop": "while True:\n    pass",
    "extra whitespace and blank lines": (
        "a, b = map(int, input().split())\nprint()\nprint('  ', a + b, '  ')\nprint()"
    ),
    "reads sys.stdin": "import sys\nprint(sum(map(int, sys.stdin.read().split())))",
    "main guard": "def main():\n    a, b = map(int, input().split())\n    print(a + b)\n\n"
    "if __name__ == '__main__':\n    main()",
    "exit() after printing": f"{READ_ADD}exit()",
    "sys.exit() after printing": f"import sys\n{READ_ADD}sys.exit(0)",
    "global counter": "total = 0\ndef add(x):\n    global total\n    total += x\nfor x in "
    "map(int, input().split()):\n    add(x)\nprint(total)",
    "sys.stdin.buffer": "import sys\nprint(sum(map(int, sys.stdin.buffer.read().split())))",
    "writes to fd 1 itself": "import os\nos.write(1, b'3\\n')",
    "bare stdin.readline": "a, b = map(int, stdin.readline().split())\nprint(a + b)",
    "from sys import stdin": (
        "from sys import stdin\na, b = map(int, stdin.readline().split())\nprint(a + b)"
    ),
    "input = sys.stdin.readline": (
        "import sys\ninput = sys.stdin.readline\nprint(sum(map(int, input().split())))"
    ),
    "open(0)": "print(sum(map(int, open(0).read().split())))",
    "sys.stdout.write": (
        "import sys\na, b = map(int, input().split())\nsys.stdout.write(str(a + b))"
    ),
}


@pytest.fixture(scope="module")
def verl_prime_code():
    """verl's prime_code with its time limits cut to TIMEOUT_S (its rule is unchanged otherwise)."""
    prime = verl_module("verl.utils.reward_score.prime_code")
    checked = prime.apps_check_correctness

    def shortened(in_outs, generation, timeout=10, debug=False):
        return checked(
            in_outs=in_outs, generation=generation, timeout=min(timeout, TIMEOUT_S), debug=debug
        )

    prime.apps_check_correctness = shortened
    yield prime.compute_score
    prime.apps_check_correctness = checked


def scores(verl_compute_score, program: str, ground_truth: str) -> tuple[float, float]:
    keel_score, metadata = compute_score(
        program, ground_truth, continuous=True, timeout_s=TIMEOUT_S
    )
    verl_score, _ = verl_compute_score(program, ground_truth, continuous=True)
    if keel_score is not True:
        assert len(metadata) == min(len(json.loads(ground_truth)["inputs"]), 10)
    return float(keel_score), float(verl_score)


@pytest.mark.parametrize("name", STDIN_PROGRAMS)
def test_a_stdin_program_scores_as_in_verl(verl_prime_code, name):
    keel_score, verl_score = scores(verl_prime_code, STDIN_PROGRAMS[name], ADD)
    assert keel_score == pytest.approx(verl_score), name


def test_the_programs_span_every_score():
    """The comparison above means something: right, partly right and wrong programs among them."""
    got = {
        name: compute_score(program, ADD, timeout_s=TIMEOUT_S)[0]
        for name, program in STDIN_PROGRAMS.items()
    }
    assert (
        got["correct, in a fence after prose"] == 1.0
        and got["extra whitespace and blank lines"] == 1.0
    )
    assert got["wrong on a negative number"] == pytest.approx(2 / 3)
    assert got["endless loop"] == got["syntax error"] == got["exit() after printing"] == 0.0


@pytest.mark.parametrize(
    "program",
    [
        "print(round(int(input()) / 3, 7))",
        "print(round(int(input()) / 3, 2))",
        "print(int(input()) / 3, 0)",
    ],
)
def test_floats_are_compared_as_in_verl(verl_prime_code, program):
    keel_score, verl_score = scores(verl_prime_code, program, THIRD)
    assert keel_score == pytest.approx(verl_score)


def test_only_the_first_ten_tests_count(verl_prime_code):
    keel_score, verl_score = scores(verl_prime_code, "print(input())", ELEVEN)
    assert keel_score == verl_score == 1.0


CALL_PROGRAMS = {
    "class Solution": "class Solution:\n    def pair(self, a, b):\n        return [a, b]",
    "plain function returning a tuple": "def pair(a, b):\n    return (a, b)",
    "wrong": "def pair(a, b):\n    return [b, a]",
    "right on two of three": "def pair(a, b):\n    return [a, b] if a != 5 else [b, a]",
    "right on two, with an example printed": "def pair(a, b):\n    return [a, b] if a != 5 else "
    "[b, a]\nprint(pair(1, 2))",
    "missing function": "def other(a, b):\n    return [a, b]",
    "crashes": "def pair(a, b):\n    return [a + b, None][5]",
    "returns a set": "def pair(a, b):\n    return {1}",
}


@pytest.mark.parametrize("name", CALL_PROGRAMS)
def test_a_call_style_program_scores_as_in_verl(verl_prime_code, name):
    keel_score, verl_score = scores(verl_prime_code, f"```python\n{CALL_PROGRAMS[name]}\n```", CALL)
    assert keel_score == pytest.approx(verl_score), name


def test_a_call_style_program_failing_one_test_scores_what_it_prints():
    """verl's per-test pass leaves fn_name out: after one failure the tests run as stdin programs,
    so two right answers of three score 0, and a printed example that matches a test's output
    counts."""
    assert compute_score(CALL_PROGRAMS["class Solution"], CALL) == (True, {})
    assert compute_score(CALL_PROGRAMS["right on two of three"], CALL)[0] == 0.0
    score, metadata = compute_score(CALL_PROGRAMS["right on two, with an example printed"], CALL)
    assert score == pytest.approx(1 / 3) and metadata[0]["test_case"]["res"] == "[True]"


def test_a_value_that_claims_equality_does_not_pass_in_keel(verl_prime_code):
    """An int whose __eq__ always says yes passes every test in verl; keel compares what the program
    returned as plain data, outside the jail."""
    program = (
        "class Yes(int):\n    def __eq__(self, other):\n        return True\ndef pair(a, b):\n    "
        "return Yes(0)"
    )
    assert verl_prime_code(program, CALL, continuous=True)[0] == 1.0
    assert compute_score(program, CALL)[0] == 0.0


def test_metadata_says_what_went_wrong_as_verl_does():
    _, metadata = compute_score(STDIN_PROGRAMS["wrong on a negative number"], ADD)
    assert metadata[2]["error_message"] == "Wrong Answer" and metadata[2]["output"] == "14\n"
    assert metadata[2]["test_case"] == {"input": "10 -4\n", "output": "6\n", "res": "[False]"}
    _, metadata = compute_score("print(1 +", ADD)
    assert "SyntaxError" in metadata[0]["error"] and metadata[0]["test_case"]["res"] == "[-2]"


def test_prime_code_and_code_exec_read_verl_rows():
    right = STDIN_PROGRAMS["correct, in a fence after prose"]
    assert prime_code("codecontests", right, ADD) == 1.0
    # the row's object, not only its JSON
    assert code_exec("codecontests", right, json.loads(ADD)) == 1.0
    assert prime_code("taco", STDIN_PROGRAMS["wrong on a negative number"], ADD) == pytest.approx(
        2 / 3
    )


def test_keels_own_form_keeps_its_rule():
    tests = [{"input": "2 3\n", "output": "5"}, {"input": "10 -4\n", "output": "6"}]
    assert code_exec("code", f"```py\n{READ_ADD}```", json.dumps(tests)) == 1.0
    assert code_exec("code", "print(5)", tests) == 0.5
    assert run_python("print(input()[::-1])", "abc\n", Limits()) == "cba\n"


@pytest.mark.parametrize(
    "ground_truth, shown",
    [
        ({"input": ["1"], "output": ["1"]}, "['input', 'output']"),
        ([{"stdin": "1", "stdout": "1"}], "['stdin', 'stdout']"),
        ("print(1)", "not JSON"),
        ({"inputs": ["1", "2"], "outputs": ["1"]}, "2 inputs and 1 outputs"),
        ([], "empty"),
    ],
)
def test_test_cases_in_another_form_are_refused_with_both_forms(ground_truth, shown):
    for scorer in (code_exec, prime_code):
        with pytest.raises(KeelError) as refused:
            scorer("codecontests", READ_ADD, ground_truth)
        assert refused.value.code == "KEEL-R009"
        assert shown in refused.value.message
        assert '"inputs"' in refused.value.message and '"input"' in refused.value.message
        assert "reward function" not in refused.value.fix


def test_rows_are_checked_before_training_and_the_bad_one_named():
    rows = [
        SimpleNamespace(index=i, data_source="apps", ground_truth=truth)
        for i, truth in enumerate([ADD, CALL, json.dumps({"input": "1", "output": "1"})])
    ]
    check_ground_truths(rows[:2])
    with pytest.raises(KeelError) as refused:
        check_ground_truths(rows)
    assert refused.value.code == "KEEL-R009" and refused.value.message.startswith(
        "row 2 (data_source 'apps')"
    )


@pytest.mark.parametrize(
    "attack",
    [
        # takes the harness down
        "import posix\nposix.kill(posix.getppid(), 9)",
        "import posix\nfor fd in range(3, 20):\n    try:\n"
        '        posix.write(fd, b\'[{"kind": "ran", "printed": "3"}]\')\n'
        # writes a report of its own
        "    except OSError:\n        pass",
    ],
)
def test_a_program_that_attacks_the_harness_gains_nothing(attack):
    """The harness shares the jail with the program: whatever the program does to it, the score is
    what its answers earn (here none), and keel goes on."""
    score, metadata = compute_score(f"{attack}\nprint(0)", ADD, timeout_s=TIMEOUT_S)
    assert score == 0.0 and len(metadata) == 3
