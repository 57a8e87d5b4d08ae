"""The program keel's jail runs to test a model's solution the way verl's `prime_code` runs it
(verl/utils/reward_score/prime_code/testing_util.py), so that the same program passes the same
tests.

keel never imports this file: keel.rewards.verl.code_tests hands its text to the jail as the
program, and a JSON job on stdin: {"code", "fn_name", "inputs", "timeout_s", "total_s",
"report_bytes"}. Each test runs in a fresh child process, killed after timeout_s + 1 seconds as
verl's global timeout kills its own, or when the whole run has taken total_s (verl's pass over every
test runs in one process given timeout_s + 1 seconds in all). The harness prints, for each test,
what the program printed (stdin tests) or returned (call-style tests), or how it failed. Comparing
with the expected output happens outside the jail: a program can lie about what it printed, but
never sees what was expected, and an object whose `__eq__` always says yes cannot leave the jail.

Everything the program meets is as verl sets it: verl's prelude of star imports, stdin programs
wrapped in a function `code()` (top-level imports kept outside it, a trailing `if __name__ ==
'__main__':` block unwrapped), `exit`, `quit` and the process and file functions verl's
`reliability_guard` removes set to None, stdout and stdin bound to the null device while the module
loads, stdin served from the test's input while `code()` runs, SystemExit swallowed.
"""

import ast
import builtins
import faulthandler
import importlib
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import traceback
import types

PRELUDE_MODULES = (
    "string",
    "re",
    "datetime",
    "collections",
    "heapq",
    "bisect",
    "copy",
    "math",
    "random",
    "statistics",
    "itertools",
    "functools",
    "operator",
    "io",
    "sys",
    "json",
)
# What verl's prelude defines, in its order: later star imports shadow earlier ones, and the plain
# imports rebind `datetime` and the rest to the modules.
PRELUDE = (
    "".join(f"from {name} import *\n" for name in (*PRELUDE_MODULES, "builtins", "typing"))
    + "".join(f"import {name}\n" for name in PRELUDE_MODULES)
    + "sys.setrecursionlimit(6*10**5)\n"
)

# Set to None before the solution loads, as verl's reliability_guard does: a program calling them
# fails.
GUARDED_OS = (
    "kill",
    "system",
    "putenv",
    "remove",
    "removedirs",
    "rmdir",
    "fchdir",
    "setuid",
    "fork",
    "forkpty",
    "killpg",
    "rename",
    "renames",
    "truncate",
    "replace",
    "unlink",
    "fchmod",
    "fchown",
    "chmod",
    "chown",
    "chroot",
    "lchflags",
    "lchmod",
    "lchown",
    "getcwd",
    "chdir",
)
GUARDED_MODULES = ("ipdb", "joblib", "resource", "psutil", "tkinter", "subprocess", "ctypes")


def guard() -> None:
    faulthandler.disable()
    builtins.exit = builtins.quit = builtins.help = None
    os.environ["OMP_NUM_THREADS"] = "1"
    for name in GUARDED_OS:
        setattr(os, name, None)
    shutil.rmtree = shutil.move = shutil.chown = None
    subprocess.Popen = None
    for name in GUARDED_MODULES:
        sys.modules[name] = None


def without_main_guard(code: str) -> str:
    """A program whose last statement is `if __name__ == '__main__':` runs that block's body."""
    try:
        tree = ast.parse(code)
        last = tree.body[-1]
        if isinstance(last, ast.If) and ast.unparse(last.test).strip() == "__name__ == '__main__'":
            return ast.unparse(tree.body[:-1]) + "\n" + ast.unparse(last.body)
    # unparsable programs go on as written, and fail to compile below
    except Exception:
        pass
    return code


def as_function(code: str) -> str:
    """verl's wrapping of a stdin program: every line but the leading imports indented by a tab into
    `def code():`, which is then called once per test."""
    lines, started = [], False
    for line in without_main_guard(code).split("\n"):
        if not line.startswith(("from ", "import ")) and not started:
            lines.append("stdin = sys.stdin\nstdout = sys.stdout\ndef code():\n")
            started = True
        lines.append(("\t" if started else "") + line + "\n")
    return "".join(lines)


def load(source: str) -> types.ModuleType:
    module = types.ModuleType("tmp_sol")
    exec(compile(source, "<string>", "exec"), module.__dict__)
    sys.modules["tmp_sol"] = module
    return module


def failure(kind: str, error: BaseException) -> dict:
    said = traceback.format_exc()
    return {
        "kind": kind,
        "error": repr(error),
        "traceback": "Traceback (most recent call last):\n  "
        + said[said.find('File "<string>"') :],
    }


def run_stdin(code: str, test_input: str) -> dict:
    try:
        method = load(PRELUDE + as_function(code)).code
    except Exception as error:
        return failure("compile", error)
    lines = iter(test_input.split("\n"))
    # what the module bound as `stdin`: verl serves the input through it too
    outer = sys.stdin
    outer.readline = lambda *args: next(lines)
    outer.readlines = lambda *args: test_input.split("\n")
    outer.read = lambda *args: test_input
    builtins.open = lambda *args, **kwargs: io.StringIO(test_input)
    sys.stdin = io.StringIO(test_input)
    quiet, printed = sys.stdout, io.StringIO()
    # as verl's capture has it: close() with no argument raises
    printed.close = lambda _: 1
    sys.stdout = printed
    try:
        method()
    except SystemExit:
        pass
    except Exception as error:
        return failure("error", error)
    finally:
        sys.stdout = quiet
    return {"kind": "ran", "printed": printed.getvalue()}


def encoded(value):
    """A returned value as plain JSON that keeps tuples apart from lists and dict keys' types."""
    if value is None or value is True or value is False:
        return value
    for kind in (str, int, float):
        if isinstance(value, kind):
            return (
                kind(value) if type(value) is kind else getattr(kind, f"__{kind.__name__}__")(value)
            )
    if isinstance(value, (tuple, list)):
        return {"tuple" if isinstance(value, tuple) else "list": [encoded(item) for item in value]}
    return {"dict": [[encoded(key), encoded(item)] for key, item in dict.items(value)]}


def run_call(code: str, fn_name: str, test_input: str) -> dict:
    try:
        module = load(PRELUDE + code)
        target = module.Solution() if "class Solution" in code else module
        method = getattr(target, fn_name)
    except Exception as error:
        return failure("compile", error)
    try:
        args = [json.loads(line) for line in test_input.split("\n")]
        if isinstance(args[0], dict):
            # JSON keys are strings; verl makes them ints again (and keeps only that argument)
            try:
                args = [{int(key): item for key, item in args[0].items()}]
            except Exception:
                pass
    except Exception:
        return {"kind": "broken"}
    try:
        output = method(*args)
        shown = json.dumps(output)
        return {"kind": "returned", "value": encoded(output), "shown": shown}
    except Exception as error:
        return failure("error", error)


def run_one(job: dict, index: int) -> dict:
    null = open(os.devnull, "w")
    sys.stdin, sys.stdout, sys.stderr = open(os.devnull), null, null
    guard()
    if job["fn_name"] is None:
        return run_stdin(job["code"], job["inputs"][index])
    return run_call(job["code"], job["fn_name"], job["inputs"][index])


def child(job: dict, index: int, out: int, harness_out: int) -> None:
    # the program may rebind the modules' names
    write, dumps, leave = os.write, json.dumps, os._exit
    os.setpgid(0, 0)
    # the program's own writes to fd 1 go nowhere, as in verl
    os.close(harness_out)
    try:
        report = dumps(run_one(job, index))
    # e.g. SystemExit while loading, a report that does not encode
    except BaseException:
        report = '{"kind": "broken"}'
    data = report.encode("utf-8", "surrogatepass")
    while data:
        data = data[write(out, data) :]
    leave(0)


def collect(reader: int, pid: int, job: dict, deadline: float) -> dict:
    """The child's report; a timeout or an oversized report when it ran past either."""
    data, verdict = bytearray(), None
    while verdict is None:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([reader], [], [], left)[0]:
            verdict = {"kind": "timeout"}
            break
        chunk = os.read(reader, 1 << 16)
        if not chunk:
            break
        data += chunk
        if len(data) > job["report_bytes"]:
            verdict = {"kind": "output limit"}
    # its process group: whatever it started goes too
    for target in (-pid, pid):
        try:
            os.kill(target, signal.SIGKILL)
        except OSError:
            pass
    os.waitpid(pid, 0)
    if verdict is not None:
        return verdict
    try:
        return json.loads(data.decode("utf-8", "surrogatepass"))
    except ValueError:
        return {"kind": "broken"}


def main() -> None:
    job = json.loads(sys.stdin.read())
    # loaded once here rather than in every test's process
    for name in (*PRELUDE_MODULES, "typing"):
        importlib.import_module(name)
    harness_out, null = os.dup(1), os.open(os.devnull, os.O_RDWR)
    # verl's child process has the null device there
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    reports, started = [], time.monotonic()
    for index in range(len(job["inputs"])):
        deadline = time.monotonic() + job["timeout_s"] + 1
        if job["total_s"] is not None:
            deadline = min(deadline, started + job["total_s"])
        if deadline <= time.monotonic():
            reports.append({"kind": "timeout"})
            continue
        reader, writer = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(reader)
            child(job, index, writer, harness_out)
        os.close(writer)
        reports.append(collect(reader, pid, job, deadline))
        os.close(reader)
    with os.fdopen(harness_out, "w") as out:
        out.write(json.dumps(reports))


if __name__ == "__main__":
    main()
