"""Run untrusted Python (a model's solution) in a subprocess that cannot hurt the run.

Layers, each for a different escape:
- resource limits (CPU seconds, address space, file size) and a wall-clock kill of the whole
  process group: infinite loops, memory bombs, huge outputs;
- an audit hook installed before the solution runs (PEP 578; user code cannot remove it) that
  refuses sockets, new processes (fork, exec, spawn, system), native code (ctypes), and any file
  access outside the solution's temporary directory other than reading Python's own library;
- a temporary working directory, removed afterwards, and an environment with nothing inherited.
It is a strong fence for model-written code, not a security boundary against a determined
attacker with a kernel exploit; run keel's reward workers in a container for that.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


class SandboxViolation(Exception):
    """The solution was stopped: a timeout, a limit, or a refused operation. Not scored."""


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    output_bytes: int = 1 << 16


# Runs first in the child, then executes the solution. Allowed reads: the solution's directory and
# the interpreter's own files (imports); allowed writes: the solution's directory only.
_PRELUDE = r'''
import os, sys
_HOME = os.path.realpath(os.getcwd())
_LIBS = tuple(os.path.realpath(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix} | set(sys.path) if p)
_DENY_PREFIXES = ("socket.", "subprocess.", "os.fork", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
                  "os.kill", "ctypes.", "pty.", "_posixsubprocess")
_PATH_EVENTS = {"open", "os.listdir", "os.scandir", "os.remove", "os.rename", "os.rmdir", "os.mkdir",
                "os.chmod", "os.chown", "os.link", "os.symlink", "os.truncate", "shutil.rmtree", "os.chdir"}

def _inside(path, roots):
    real = os.path.realpath(path)
    return any(real == r or real.startswith(r + os.sep) for r in roots)

def _guard(event, args):
    if event.startswith(_DENY_PREFIXES):
        raise PermissionError(f"keel sandbox: {event} is not allowed")
    if event == "import" and args[0] in ("ctypes", "_ctypes", "multiprocessing"):
        raise PermissionError(f"keel sandbox: import {args[0]} is not allowed")
    if event in _PATH_EVENTS and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        mode_writes = len(args) > 1 and isinstance(args[1], str) and set(args[1]) & set("wax+")
        flags_write = len(args) > 2 and isinstance(args[2], int) and args[2] & (
            os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC)
        reading = event in ("os.listdir", "os.scandir") or (event == "open" and not (mode_writes or flags_write))
        writing = not reading
        roots = (_HOME,) if writing else (_HOME,) + _LIBS
        if not _inside(path, roots):
            raise PermissionError(f"keel sandbox: {event} {path!r} is outside the solution's directory")

sys.addaudithook(_guard)
sys.argv = ["solution.py"]
with open("solution.py") as _f:
    _code = compile(_f.read(), "solution.py", "exec")
del _f
exec(_code, {"__name__": "__main__"})
'''


def _limit_resources(limits: Limits):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s))
        memory = limits.memory_mb * 2 ** 20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.output_bytes, limits.output_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_python(code: str, stdin: str = "", limits: Limits = Limits()) -> str:
    """The solution's stdout; SandboxViolation when it was stopped, with the reason."""
    with tempfile.TemporaryDirectory(prefix="keel_sandbox_") as home:
        Path(home, "solution.py").write_text(code)
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _PRELUDE], cwd=home, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin", "HOME": home},
            preexec_fn=_limit_resources(limits), start_new_session=True)
        try:
            stdout, stderr = process.communicate(stdin.encode(), timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the solution and anything it left behind
            process.communicate()
            raise SandboxViolation(f"timeout: ran past {limits.wall_s} s") from None
    return _outcome(process.returncode, stdout, stderr, limits)


def _outcome(returncode: int, stdout: bytes, stderr: bytes, limits: Limits) -> str:
    err = stderr.decode(errors="replace")
    if "keel sandbox:" in err:
        raise SandboxViolation("blocked: " + err[err.index("keel sandbox:") + len("keel sandbox: "):].splitlines()[0])
    if returncode == -signal.SIGXCPU or returncode == -signal.SIGKILL:
        raise SandboxViolation(f"cpu limit: over {limits.cpu_s} s of CPU")
    if "MemoryError" in err:
        raise SandboxViolation(f"memory limit: over {limits.memory_mb} MB")
    if returncode == -signal.SIGXFSZ or len(stdout) > limits.output_bytes:
        raise SandboxViolation(f"output limit: over {limits.output_bytes} bytes")
    return stdout.decode(errors="replace")
