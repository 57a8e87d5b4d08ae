"""How one program runs in the jail: the bubblewrap command line (namespaces, read-only mounts, an
in-memory scratch directory, an unprivileged user), the seccomp filter (seccomp_filter.py), rlimits,
the run's cgroup, output read as it comes, and the whole tree killed at the end.
keel.rewards.jail.sandbox decides what a run's end means and which jail this machine gives.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from keel.rewards.jail import cgroups, userns
from keel.rewards.jail.cgroups import RunGroup
from keel.rewards.jail.launcher import launched
from keel.rewards.jail.seccomp_filter import seccomp_program

# how often a run's CPU time and OOM kills are read from its cgroup
CPU_POLL_S = 0.1


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    output_bytes: int = 1 << 16
    # the program's processes and threads: a fork bomb stops here
    processes: int = 32
    open_files: int = 64
    # the writable /sandbox, in memory
    scratch_mb: int = 16


# nobody
SANDBOX_UID = 65534
SCRATCH = "/sandbox"
AS_NOBODY, IN_USER_NAMESPACE, NO_JAIL = (
    f"bubblewrap as uid {SANDBOX_UID}",
    "bubblewrap in a user namespace",
    "none",
)
# no bubblewrap, but root need not run the program as root
NO_JAIL_AS_NOBODY = f"none, as uid {SANDBOX_UID}"
# bubblewrap's own processes in a run: its monitor and the namespace's first process
BWRAP_PROCESSES = 2


def _interpreter() -> tuple[str, str]:
    """(the interpreter the solution runs on, the directory it needs): the base Python, not a venv,
    since -I -S never reads site-packages anyway."""
    executable = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    return executable, prefix if executable.startswith(prefix + os.sep) else os.path.dirname(
        executable
    )


def _bwrap_argv(as_root: bool, solution: str, limits: Limits, seccomp_fd: int) -> list[str]:
    """bubblewrap's command line, up to the interpreter."""
    python, python_dir = _interpreter()
    argv = [
        "bwrap",
        *(["--seccomp", str(seccomp_fd)] if seccomp_program() else []),
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
        "--setenv",
        "HOME",
        SCRATCH,
    ]
    # a user namespace: the solution keeps no capability, even over its own namespaces
    if not as_root:
        argv += [
            "--unshare-user",
            "--uid",
            str(SANDBOX_UID),
            "--gid",
            str(SANDBOX_UID),
            "--disable-userns",
            "--cap-drop",
            "ALL",
        ]
    argv += [*_filesystem(python_dir, solution, limits), "--"]
    # mounts need root; the solution does not: every uid becomes nobody, no capability left
    if as_root:
        argv += [
            "setpriv",
            f"--reuid={SANDBOX_UID}",
            f"--regid={SANDBOX_UID}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
        ]
    return argv + [python]


def _filesystem(python_dir: str, solution: str, limits: Limits) -> list[str]:
    """The filesystem the solution sees: /usr and the interpreter read-only, a /dev, /proc and
    /dev/shm of its own, a small writable scratch directory to start in with its file (read-only)
    there, everything else read-only."""
    argv = ["--ro-bind", "/usr", "/usr"]
    # merged /usr: links; otherwise directories
    for top in ("bin", "lib", "lib32", "lib64", "sbin"):
        path = Path("/", top)
        if path.is_symlink():
            argv += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            argv += ["--ro-bind", str(path), str(path)]
    if not python_dir.startswith("/usr/"):
        argv += ["--ro-bind", python_dir, python_dir]
    argv += [
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--size",
        "65536",
        "--tmpfs",
        "/dev/shm",
        "--remount-ro",
        "/dev/shm",
        "--perms",
        "1777",
        "--size",
        str(limits.scratch_mb << 20),
        "--tmpfs",
        SCRATCH,
        "--ro-bind",
        solution,
        f"{SCRATCH}/solution.py",
        "--chdir",
        SCRATCH,
        "--remount-ro",
        "/",
    ]
    return argv


def _command(
    mode: str, solution: str, limits: Limits, args: list[str], seccomp_fd: int
) -> list[str]:
    if mode in (NO_JAIL, NO_JAIL_AS_NOBODY):
        return [_interpreter()[0], "-I", "-S", solution, *args]
    return _bwrap_argv(mode == AS_NOBODY, solution, limits, seccomp_fd) + [
        "-I",
        "-S",
        f"{SCRATCH}/solution.py",
        *args,
    ]


def _launch_spec(
    limits: Limits, mode: str, group: RunGroup | None, own_namespace: bool, report_fd: int
) -> dict:
    """What the launcher sets on the run's first process before it execs bubblewrap (or the
    interpreter): launcher.py says how and why there rather than in a preexec_fn."""
    rlimits = {
        "RLIMIT_CPU": limits.cpu_s,
        "RLIMIT_FSIZE": limits.scratch_mb << 20,
        "RLIMIT_NOFILE": limits.open_files,
        "RLIMIT_CORE": 0,
    }
    # no group to bound the tree's memory: each process's address space, at least
    if group is None:
        rlimits["RLIMIT_AS"] = limits.memory_mb << 20
    nproc = None
    if group is None and (own_namespace or mode in (AS_NOBODY, NO_JAIL_AS_NOBODY)):
        # In a user namespace of bubblewrap's own, bubblewrap's processes count as the program's
        # user.
        nproc = limits.processes + (BWRAP_PROCESSES if mode == IN_USER_NAMESPACE else 0)
    return {
        "report_fd": report_fd,
        "cgroup_procs": group.procs_files() if group else [],
        "rlimits": rlimits,
        "own_namespace": group is None and own_namespace,
        "nproc": nproc,
        "as_nobody": _drops_to_nobody(mode),
    }


def _drops_to_nobody(mode: str) -> bool:
    """Where root becomes uid 65534 before the exec: without bubblewrap, and before an unprivileged
    bubblewrap (which would otherwise map the program's user to root outside its namespace)."""
    return os.getuid() == 0 and mode in (IN_USER_NAMESPACE, NO_JAIL_AS_NOBODY)


@dataclass
class Finished:
    returncode: int
    stdout: bytes
    stderr: bytes
    # why keel stopped it (timeout, output, CPU), or None
    stopped: str | None
    # the whole tree's CPU time, from its cgroup (None without one)
    cpu_s: float | None = None
    # the kernel killed it for the group's memory limit
    oom_killed: bool = False


def run_jailed(
    mode: str, code: str, stdin: str, limits: Limits, args: list[str] = (), accounted: bool = True
) -> Finished:
    """One run, in its own cgroup when `accounted` and this machine allows one, else in a user
    namespace of its own where RLIMIT_NPROC counts its processes; the group is removed however
    the run ends (a scorer's timeout included)."""
    # The group also holds bwrap, the tmpfs scratch directory's pages and page tables: some slack.
    group = (
        cgroups.create(
            ((limits.memory_mb + limits.scratch_mb) << 20) + (32 << 20),
            limits.processes + (BWRAP_PROCESSES if mode in (AS_NOBODY, IN_USER_NAMESPACE) else 0),
        )
        if accounted
        else None
    )
    try:
        return _run_in(mode, code, stdin, limits, list(args), group)
    finally:
        if group is not None:
            group.remove()


def _run_in(
    mode: str, code: str, stdin: str, limits: Limits, args: list[str], group: RunGroup | None
) -> Finished:
    with tempfile.TemporaryDirectory(prefix="keel_sandbox_") as host:
        solution, stdin_file = Path(host, "solution.py"), Path(host, "stdin")
        solution.write_text(code)
        stdin_file.write_text(stdin)
        # the jail's user reads it through a bind mount, never writes it
        solution.chmod(0o444)
        # its user reaches the solution; without a jail, this is its scratch directory
        if _drops_to_nobody(mode):
            os.chown(host, SANDBOX_UID, SANDBOX_UID)
        Path(host, "seccomp.bpf").write_bytes(
            (mode not in (NO_JAIL, NO_JAIL_AS_NOBODY) and seccomp_program()) or b""
        )
        with (
            open(stdin_file, "rb") as stdin_handle,
            open(Path(host, "seccomp.bpf"), "rb") as seccomp,
        ):
            process = _launch(
                _command(mode, str(solution), limits, args, seccomp.fileno()),
                limits,
                mode,
                group,
                host,
                stdin_handle,
                seccomp.fileno(),
            )
        try:
            stdout, stderr, stopped = _collect(process, limits, group)
        finally:
            _kill_tree(process, group)
            process.wait()
            process.stdout.close()
            process.stderr.close()
    if group is None:
        return Finished(process.returncode, stdout, stderr, stopped)
    return Finished(
        process.returncode, stdout, stderr, stopped, group.cpu_seconds(), group.killed_for_memory()
    )


def _launch(
    command: list[str],
    limits: Limits,
    mode: str,
    group: RunGroup | None,
    host: str,
    stdin,
    seccomp_fd: int,
) -> subprocess.Popen:
    """The run's first process, through the launcher; OSError when it could not set the jail up
    (read from a pipe the exec closes, so nothing the program does can look like it)."""
    report_r, report_w = os.pipe()
    try:
        spec = _launch_spec(limits, mode, group, group is None and userns.available(), report_w)
        process = subprocess.Popen(
            launched(_interpreter()[0], spec, command),
            cwd=host,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin", "HOME": host},
            start_new_session=True,
            pass_fds=(seccomp_fd, report_w),
        )
        os.close(report_w)
        report_w = -1
        with os.fdopen(report_r, "rb") as report:
            report_r = -1
            # EOF at the exec, or the launcher's reason before it exits
            refused = report.read()
    finally:
        for fd in (report_r, report_w):
            if fd >= 0:
                os.close(fd)
    if refused:
        process.wait()
        process.stdout.close(), process.stderr.close()
        raise OSError(f"the code jail could not be set up: {refused.decode(errors='replace')}")
    return process


def _collect(
    process: subprocess.Popen, limits: Limits, group: RunGroup | None
) -> tuple[bytes, bytes, str | None]:
    """Both pipes read as they fill, never more than the limit held: an endless print costs nothing.
    With a cgroup, the tree's CPU time and OOM kills are watched too: RLIMIT_CPU starts again in
    every child, and a killed child may leave the rest of the tree waiting."""
    buffers = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    deadline = time.monotonic() + limits.wall_s
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return b"", b"", f"timeout: ran past {limits.wall_s} s"
            if group is not None and group.cpu_seconds() > limits.cpu_s:
                return b"", b"", f"cpu limit: over {limits.cpu_s} s of CPU"
            # the verdict is in: no need to wait
            if group is not None and group.killed_for_memory():
                return b"", b"", f"memory limit: over {limits.memory_mb} MB"
            for key, _ in selector.select(min(left, CPU_POLL_S)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffers[key.fd] += chunk
                if len(buffers[key.fd]) > limits.output_bytes:
                    return b"", b"", f"output limit: over {limits.output_bytes} bytes"
    return bytes(buffers[process.stdout.fileno()]), bytes(buffers[process.stderr.fileno()]), None


def _kill_tree(process: subprocess.Popen, group: RunGroup | None) -> None:
    """The cgroup names every process of the run. Without one: bwrap leads its own session, and its
    namespace's processes die with it (--die-with-parent; a pid namespace ends with its first
    process); without the jail, the session is the tree."""
    if group is not None:
        group.kill()
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
