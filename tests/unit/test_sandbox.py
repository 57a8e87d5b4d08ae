"""Model-written code runs fenced: loops, memory and fork bombs, network calls and reads outside its
directory all end as not-scored with the reason, and the training process is unharmed."""

import json
import os
from types import SimpleNamespace

import pytest

from keel.rewards.reward_fn import RewardScorer
from keel.rewards.sandbox import Limits, SandboxViolation, run_python
from keel.rewards.scorers import code_exec, extract_code

TESTS = json.dumps([{"input": "2 3\n", "output": "5"}, {"input": "10 -4\n", "output": "6"}])
LIMITS = Limits(cpu_s=2, wall_s=4, memory_mb=256)


def test_a_correct_program_passes_and_a_wrong_one_scores_zero():
    good = "Here you go:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert code_exec("codecontests", good, TESTS) == 1.0
    assert code_exec("codecontests", "```python\nprint(5)\n```", TESTS) == 0.5  # passes one of two
    assert code_exec("codecontests", "raise SystemExit(1)", TESTS) == 0.0     # a crash is a wrong answer
    assert extract_code("no fences") == "no fences"


@pytest.mark.parametrize("attack, reason", [
    ("while True:\n    pass", "cpu limit"),
    ("x = bytearray(10 ** 10)", "memory limit"),
    ("import os\nwhile True:\n    os.fork()", "blocked: os.fork"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 9))", "blocked: socket."),
    ("print(open('/etc/hostname').read())", "blocked: open '/etc/hostname'"),
    (f"open({os.getcwd()!r} + '/escaped.txt', 'w').write('x')", "is outside the solution's directory"),
    ("import subprocess\nsubprocess.run(['sh', '-c', 'echo hi'])", "blocked: subprocess.Popen"),
    ("import ctypes", "blocked: import ctypes"),
    ("print('x' * 10 ** 6)", "output limit"),
])
def test_attacks_are_stopped_with_the_reason(attack, reason):
    with pytest.raises(SandboxViolation) as info:
        run_python(attack, "", LIMITS)
    assert reason in str(info.value)
    assert not os.path.exists("escaped.txt")


def test_stopped_programs_are_not_scored_and_the_trainer_carries_on():
    scorer = RewardScorer(by_source={"code": {"code_exec": 1.0}}, max_not_scored_ratio=1.0)
    row = SimpleNamespace(data_source="code", ground_truth=TESTS, extra_info={}, index=0)
    result = scorer.score_batch([row, row], ["```python\nwhile True: pass\n```",
                                             "a, b = map(int, input().split())\nprint(a + b)"])
    assert result.scored.tolist() == [False, True] and result.scores[1] == 1.0
    assert result.reasons[0].startswith("raised SandboxViolation")
    assert os.getpid() > 0  # still here
