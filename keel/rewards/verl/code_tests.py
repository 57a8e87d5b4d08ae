"""Code test cases, in verl's form and keel's, scored in keel's jail.

verl 0.9.1 scores its code data sources (codecontests, apps, codeforces, taco) with `prime_code`:
the ground truth is `{"inputs": [...], "outputs": [...]}` (stdin/stdout tests), with `"fn_name"`
for call-style tests (each input is one JSON value per line, the arguments of `fn_name`, a method
of `class Solution` when the program defines one; each output the JSON of the return value).
`compute_score` here gives verl's score on the same programs: the program is the text after the
last "```python" up to the next "```" (the whole response without one); with continuous=True
the score is True when every test passes, else the share of the first 10 tests that pass when each
runs alone, as a stdin program even for call-style rows (see `_score_verl`). A test that compiles
badly, raises or runs out of time fails; printed output is compared by verl's rules (whole text or
line by line, surrounding whitespace and blank lines ignored, lines of numbers within numpy's
allclose), returned values by equality as verl reads the expected JSON.

The program runs in keel's jail (keel.rewards.jail.code_harness inside keel.rewards.jail.sandbox);
what it printed or returned is compared outside (keel.rewards.verl.code_judge): a returned object
whose `__eq__` always says yes (which passes every test in verl) is plain data by the time it is
compared. Where keel differs
from verl on purpose: the jail's limits on memory and output stop a program without a verdict
(SandboxViolation: the sample is not scored), and the jail has the standard library only.

keel's own form, `[{"input": stdin, "output": expected stdout}]`, keeps its rule in `code_exec`:
each case run as a script, compared with trailing whitespace ignored; code_exec reads verl's form
too, scored as `prime_code` scores it. Any other ground truth is refused (KEEL-R009).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel.errors import CODE_TESTS_FORM, KeelError
from keel.rewards.jail.sandbox import Limits, SandboxViolation, run_python
from keel.rewards.verl.code_judge import judge

# continuous scores count the first 10 tests (verl: "some problems have enormous test cases")
VERL_TESTS_SCORED = 10
# per test, in the continuous pass
VERL_TEST_TIMEOUT_S = 10
# per test, in the pass over all tests (continuous=False)
VERL_ALL_TESTS_TIMEOUT_S = 5
# what one test may print, at least: more stops the program (not scored)
REPORT_BYTES = 1 << 20
# the program the jail runs, which runs the model's program (keel never imports it)
HARNESS = Path(__file__).parents[1] / "jail" / "code_harness.py"

STDIN, CALL = "stdin", "call"
VERL_FORM = (
    '{"inputs": ["1 2\\n"], "outputs": ["3\\n"]} (add "fn_name": "add" for call-style tests)'
)
KEEL_FORM = '[{"input": "1 2\\n", "output": "3"}]'


@dataclass(frozen=True)
class CodeTests:
    # "verl" | "keel"
    form: str
    inputs: list
    outputs: list
    # verl's call-style tests
    fn_name: str | None = None


def _refuse(what: str) -> KeelError:
    return KeelError(
        CODE_TESTS_FORM,
        f"the code test cases {what}; keel's code scorers read verl's form {VERL_FORM} or "
        f"keel's {KEEL_FORM}",
        f"write each row's reward_model.ground_truth (or its JSON text) as {VERL_FORM}, or as "
        f"{KEEL_FORM}: every input with its expected output, at least one test",
    )


def _items(value: Any) -> list | None:
    """A list-like column (a list, a tuple, an array read from parquet) as a list; None
    otherwise."""
    if (
        isinstance(value, (str, bytes, dict))
        or not hasattr(value, "__len__")
        or not hasattr(value, "__getitem__")
    ):
        return None
    return list(value)


def parse_tests(ground_truth: Any) -> CodeTests:
    """Either form, from the object or its JSON text; KEEL-R009 for anything else."""
    if isinstance(ground_truth, (str, bytes)):
        try:
            ground_truth = json.loads(ground_truth)
        except ValueError:
            raise _refuse(f"are text that is not JSON ({str(ground_truth)[:80]!r})") from None
    if isinstance(ground_truth, dict):
        inputs, outputs = _items(ground_truth.get("inputs")), _items(ground_truth.get("outputs"))
        if inputs is None or outputs is None:
            raise _refuse(
                f"are a dict with keys {sorted(map(str, ground_truth))}, without the lists "
                '"inputs" and "outputs"'
            )
        if len(inputs) != len(outputs) or not inputs:
            raise _refuse(f"have {len(inputs)} inputs and {len(outputs)} outputs")
        return CodeTests("verl", inputs, outputs, ground_truth.get("fn_name"))
    cases = _items(ground_truth)
    if cases and all(
        isinstance(case, dict) and "input" in case and "output" in case for case in cases
    ):
        return CodeTests(
            "keel", [case["input"] for case in cases], [case["output"] for case in cases]
        )
    if cases:
        first = cases[0]
        shown = (
            f"keys {sorted(map(str, first))}"
            if isinstance(first, dict)
            else f"a {type(first).__name__}"
        )
        raise _refuse(f'are a list whose first item has {shown}, not "input" and "output"')
    raise _refuse("are empty" if cases == [] else f"are a {type(ground_truth).__name__}")


def check_ground_truths(rows: list) -> None:
    """Before training: every row's test cases in a form the code scorers read (rows with
    `index`, `data_source` and `ground_truth`, as keel's records have them), else KEEL-R009 naming
    the first row that is not."""
    for row in rows:
        try:
            parse_tests(row.ground_truth)
        except KeelError as refused:
            raise KeelError(
                CODE_TESTS_FORM,
                f"row {row.index} (data_source {row.data_source!r}): {refused.message}",
                refused.fix,
            ) from None


_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The program keel's form runs: the last fenced code block, else the whole response."""
    blocks = _CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else text


def verl_program(response: str) -> str:
    """The program verl runs: after the last "```python", up to the next "```"."""
    return response.split("```python")[-1].split("```")[0]


def run_tests(
    program: str,
    inputs: list,
    outputs: list,
    fn_name: str | None,
    timeout_s: float,
    total_s: float | None = None,
) -> list[dict]:
    """Each test's report from the jail: what the program printed or returned, or how it failed.
    A test the data cannot express (verl fails it before running anything) is reported broken."""
    runnable = [
        i
        for i, (given, wanted) in enumerate(zip(inputs, outputs))
        if isinstance(given, str) and (fn_name is not None or isinstance(wanted, str))
    ]
    reports = [{"kind": "broken"} for _ in inputs]
    if not runnable:
        return reports
    report_bytes = max(REPORT_BYTES, 4 * max(len(str(outputs[i])) for i in runnable))
    job = {
        "code": program,
        "fn_name": fn_name,
        "inputs": [inputs[i] for i in runnable],
        "timeout_s": timeout_s,
        "total_s": total_s,
        "report_bytes": report_bytes,
    }
    # + a second a test for the fork, the report
    seconds = min(total_s or math.inf, (timeout_s + 2) * len(runnable))
    limits = Limits(
        cpu_s=math.ceil(seconds) + 5,
        wall_s=seconds + 10,
        output_bytes=report_bytes * len(runnable) + (1 << 16),
    )
    try:
        printed = run_python(HARNESS.read_text(), json.dumps(job), limits)
    except SandboxViolation as stopped:
        # the whole run: every test's time was up
        if str(stopped).startswith(("timeout", "cpu limit")):
            return [{"kind": "timeout"} for _ in inputs]
        raise
    try:
        ran = json.loads(printed)
    # the program took the harness down with it (it runs in the same process tree)
    except ValueError:
        ran = [{"kind": "broken"} for _ in runnable]
    for index, report in zip(runnable, ran):
        if not isinstance(report, dict):
            report = {"kind": "broken"}
        if report.get("kind") == "output limit":
            raise SandboxViolation(f"output limit: test {index} printed over {report_bytes} bytes")
        reports[index] = report
    return reports


def compute_score(
    solution_str: str, ground_truth: Any, continuous: bool = True, timeout_s: float | None = None
) -> tuple[float | bool, list[dict] | dict]:
    """verl's prime_code.compute_score, run in keel's jail: (True, {}) when every test passes,
    else (score, one metadata dict per test run). continuous=True: the share of the first 10 tests
    that pass; continuous=False: False (verl 0.9.1 raises UnboundLocalError there). `timeout_s`
    replaces verl's 5 s and 10 s per test. SandboxViolation when the jail stopped the program on
    memory or output; KEEL-R009 for test cases in an unknown form."""
    return _score_verl(solution_str, parse_tests(ground_truth), continuous, timeout_s)


def _judged(
    program: str,
    tests: CodeTests,
    fn_name: str | None,
    timeout_s: float,
    total_s: float | None = None,
) -> tuple[list, list[dict]]:
    """verl's result for each test (True, False, -1, -2) and its metadata."""
    results, metadata = [], []
    reports = run_tests(program, tests.inputs, tests.outputs, fn_name, timeout_s, total_s)
    for report, given, wanted in zip(reports, tests.inputs, tests.outputs):
        result, about = judge(report, given, wanted, fn_name)
        about["test_case"] = {"input": str(given), "output": str(wanted), "res": str([result])}
        results.append(result)
        metadata.append(about)
    return results, metadata


def _score_verl(
    solution_str: str, tests: CodeTests, continuous: bool, timeout_s: float | None
) -> tuple[float | bool, list[dict] | dict]:
    """verl's two passes. The first runs every test (5 s each, 6 s in all) and returns (True, {})
    when all pass. Otherwise the first 10 run one by one (10 s each) and score their share: as stdin
    programs, since verl's per-test cases leave fn_name out (a call-style program that fails one
    test scores what its printed output earns, usually 0). For stdin tests the first pass cannot
    change the share (a test passing in 5 s passes in 10), so it is skipped there."""
    program = verl_program(solution_str)
    if not continuous or tests.fn_name is not None:
        first_timeout = timeout_s or VERL_ALL_TESTS_TIMEOUT_S
        results, metadata = _judged(program, tests, tests.fn_name, first_timeout, first_timeout + 1)
        if all(result is True for result in results):
            return True, {}
        if not continuous:
            return False, metadata
    scored = CodeTests(
        tests.form, tests.inputs[:VERL_TESTS_SCORED], tests.outputs[:VERL_TESTS_SCORED]
    )
    results, metadata = _judged(program, scored, None, timeout_s or VERL_TEST_TIMEOUT_S)
    return sum(result is True for result in results) / len(results), metadata


def prime_code(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """verl's scorer for codecontests, apps, codeforces and taco:
    compute_score(continuous=True)[0]."""
    return float(compute_score(solution_str, ground_truth, continuous=True)[0])


def code_exec(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """Share of test cases the program passes, in keel's jail. keel's form: each case run as a
    script with the input on stdin, its stdout compared with trailing whitespace ignored; verl's
    form: as prime_code scores it. A program the jail stopped (time, memory, output) raises
    SandboxViolation in keel's form, and on memory or output in verl's: the sample is not scored."""
    tests = parse_tests(ground_truth)
    if tests.form == "verl":
        return float(_score_verl(solution_str, tests, True, None)[0])
    code = extract_code(solution_str)
    passed = sum(
        run_python(code, str(given)).rstrip() == str(wanted).rstrip()
        for given, wanted in zip(tests.inputs, tests.outputs)
    )
    return passed / len(tests.inputs)
