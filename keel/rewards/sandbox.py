"""Run untrusted Python (a model's solution) in an operating-system jail.

The jail is bubblewrap (`bwrap`, Debian's `bubblewrap`), the sandbox Flatpak runs apps in:
- its own pid, network, IPC and UTS namespaces: the solution cannot see or signal the trainer,
  reaches no network (not even loopback), and everything it starts dies with it;
- its own mount namespace holding only the system's programs and libraries and the interpreter,
  read-only, plus a size-limited scratch directory in memory (`/sandbox`, its working directory):
  no path on the host is writable, and no project file, dataset or home directory is visible;
- an unprivileged user: uid 65534 (`nobody`) when the trainer is root, otherwise a user
  namespace with no capabilities;
- a seccomp filter refusing new namespaces, keyrings and kernel interfaces a judge never needs;
- a cgroup per run (keel/rewards/cgroups.py) bounding the whole tree's memory, processes and CPU
  time, whose books give the CPU and memory verdicts; rlimits on top (open files, file size);
- output read as it comes and cut at the limit, and a wall-clock kill of the whole tree.
A machine that cannot give some of these (no bubblewrap, namespaces or cgroups refused, as in some
containers) runs solutions with what it has: `jail()` says which protections hold, `keel doctor`
and `keel check` print them, and `reward.sandbox.require` says what a run needs (isolation by default, or all, or none).

What the solution does inside is its own business: a refused write or connection is an error in
the program, so the test case fails, as on a judge. Only the limits (time, CPU, output, memory)
stop a program without a verdict: SandboxViolation, and the sample is not scored.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from keel.errors import SANDBOX_INCOMPLETE, KeelError
from keel.rewards import cgroups
from keel.rewards.cgroups import RunGroup

log = logging.getLogger("keel")


class SandboxViolation(Exception):
    """The solution was stopped by a limit (time, CPU, memory, output). Not scored."""


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    output_bytes: int = 1 << 16
    processes: int = 32         # a fork bomb stops here (the run's cgroup; else uid 65534's rlimit)
    open_files: int = 64
    scratch_mb: int = 16        # the writable /sandbox, in memory


# What each protection means, in the words `keel doctor` prints.
PROTECTIONS = {
    "filesystem": "read-only system directories only; writes go to a private in-memory scratch directory",
    "network": "no network (a network namespace of its own)",
    "processes": "cannot see or signal the trainer; every process it starts dies with it (a pid namespace)",
    "user": "an unprivileged user (uid 65534, or a user namespace without capabilities)",
    "syscalls": "no new namespaces, keyrings or other kernel interfaces a judge never needs (seccomp)",
    "limits": "CPU time, open files and file size limited per process (rlimits; address space and process "
              "count too where no cgroup bounds them)",
    "accounting": "memory (tmpfs, memfd and kernel memory too), processes and CPU time limited for the whole "
                  "tree by a cgroup, whose books give the verdict (a program cannot fake a limit)",
    "output": "output read as it comes and cut at the limit; the whole tree killed at the wall-clock limit",
}
SANDBOX_UID = 65534  # nobody
SCRATCH = "/sandbox"
AS_NOBODY, IN_USER_NAMESPACE, NO_JAIL = (f"bubblewrap as uid {SANDBOX_UID}", "bubblewrap in a user namespace",
                                         "none")


@dataclass(frozen=True)
class Jail:
    mode: str                       # AS_NOBODY | IN_USER_NAMESPACE | NO_JAIL
    protections: dict[str, bool]    # PROTECTIONS -> in force here
    why_not: str                    # when some are missing: what stopped them

    @property
    def complete(self) -> bool:
        return all(self.protections.values())

    def missing(self) -> list[str]:
        return [name for name, held in self.protections.items() if not held]

    def summary(self) -> str:
        """One line for `keel doctor` and `keel check`."""
        if self.complete:
            return f"{self.mode}: every protection in force ({', '.join(self.protections)})"
        return f"{self.mode}: model-written code runs without {', '.join(self.missing())} ({self.why_not})"

    def describe(self) -> list[str]:
        return [f"[{'ok' if held else 'MISSING'}] {name}: {PROTECTIONS[name]}"
                for name, held in self.protections.items()]


def _interpreter() -> tuple[str, str]:
    """(the interpreter the solution runs on, the directory it needs): the base Python, not a venv,
    since -I -S never reads site-packages anyway."""
    executable = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    return executable, prefix if executable.startswith(prefix + os.sep) else os.path.dirname(executable)


def _bwrap_argv(as_root: bool, solution: str, limits: Limits, seccomp_fd: int) -> list[str]:
    """bubblewrap's command line, up to the interpreter."""
    python, python_dir = _interpreter()
    argv = ["bwrap", *(["--seccomp", str(seccomp_fd)] if _seccomp_program() else []),
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", SCRATCH]
    if not as_root:  # a user namespace: the solution keeps no capability, even over its own namespaces
        argv += ["--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "lib", "lib32", "lib64", "sbin"):  # merged /usr: links; otherwise directories
        path = Path("/", top)
        if path.is_symlink():
            argv += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            argv += ["--ro-bind", str(path), str(path)]
    if not python_dir.startswith("/usr/"):
        argv += ["--ro-bind", python_dir, python_dir]
    argv += ["--dev", "/dev", "--proc", "/proc",
             "--size", "65536", "--tmpfs", "/dev/shm", "--remount-ro", "/dev/shm",
             "--perms", "1777", "--size", str(limits.scratch_mb << 20), "--tmpfs", SCRATCH,
             "--ro-bind", solution, f"{SCRATCH}/solution.py", "--chdir", SCRATCH, "--remount-ro", "/", "--"]
    if as_root:  # mounts need root; the solution does not: every uid becomes nobody, no capability left
        argv += ["setpriv", f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups",
                 "--bounding-set=-all", "--no-new-privs"]
    return argv + [python]


def _command(mode: str, solution: str, limits: Limits, args: list[str], seccomp_fd: int) -> list[str]:
    if mode == NO_JAIL:
        return [_interpreter()[0], "-I", "-S", solution, *args]
    return (_bwrap_argv(mode == AS_NOBODY, solution, limits, seccomp_fd)
            + ["-I", "-S", f"{SCRATCH}/solution.py", *args])


# Refused inside the jail (EPERM), as Docker's default profile refuses them: new namespaces (a user
# namespace would give the program every capability over mounts it makes, tmpfs of any size
# included), keyrings (the user's keyring outlives every run: a channel between samples), and
# kernel interfaces a judge never needs. clone3 passes its flags in memory a filter cannot read,
# so it answers ENOSYS and glibc falls back to clone, whose flags are checked.
_REFUSED_SYSCALLS = ("unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "add_key", "keyctl",
                     "request_key", "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd",
                     "perf_event_open", "bpf", "ptrace", "process_vm_readv", "process_vm_writev", "memfd_create",
                     "name_to_handle_at", "open_by_handle_at", "kexec_load", "init_module", "finit_module",
                     "delete_module", "fsopen", "fsmount", "move_mount", "open_tree")
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)


@lru_cache(maxsize=1)
def _seccomp_program() -> bytes | None:
    """The filter as BPF for bwrap --seccomp (libseccomp through pyseccomp), or None without it."""
    try:
        import pyseccomp as seccomp
    except Exception:  # not installed, or no libseccomp on this machine (pyseccomp raises RuntimeError)
        return None
    import errno

    refuse = seccomp.ERRNO(errno.EPERM)
    program = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in _REFUSED_SYSCALLS:
        try:
            program.add_rule(refuse, name)
        except (ValueError, OSError, RuntimeError):  # a call this libseccomp or architecture does not know
            log.debug("seccomp: %s unknown here, not filtered", name)
    for flag in _NAMESPACE_FLAGS:
        program.add_rule(refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    program.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as out:
        program.export_bpf(out)
        out.seek(0)
        return out.read()


def _limit_resources(limits: Limits, processes: bool, group: RunGroup | None):
    def apply() -> None:
        if group is not None:  # first: bwrap and everything under it start inside the group
            group.join()
        else:  # no group to bound the tree's memory: each process's address space, at least
            memory = limits.memory_mb << 20
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.scratch_mb << 20,) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if processes and group is None:  # counted per user, across every run: the group counts this one's
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    return apply


@dataclass
class Finished:
    returncode: int
    stdout: bytes
    stderr: bytes
    stopped: str | None             # why keel stopped it (timeout, output, CPU), or None
    cpu_s: float | None = None      # the whole tree's CPU time, from its cgroup (None without one)
    oom_killed: bool = False        # the kernel killed it for the group's memory limit


def _run(mode: str, code: str, stdin: str, limits: Limits, args: list[str] = (), accounted: bool = True) -> Finished:
    """One run, in its own cgroup when `accounted` and this machine allows one; the group is
    removed however the run ends (a scorer's timeout included)."""
    # The group also holds bwrap, the tmpfs scratch directory's pages and page tables: some slack.
    group = cgroups.create(((limits.memory_mb + limits.scratch_mb) << 20) + (32 << 20),
                           limits.processes + 4) if accounted else None
    try:
        return _run_in(mode, code, stdin, limits, list(args), group)
    finally:
        if group is not None:
            group.remove()


def _run_in(mode: str, code: str, stdin: str, limits: Limits, args: list[str], group: RunGroup | None) -> Finished:
    with tempfile.TemporaryDirectory(prefix="keel_sandbox_") as host:
        solution, stdin_file = Path(host, "solution.py"), Path(host, "stdin")
        solution.write_text(code)
        stdin_file.write_text(stdin)
        solution.chmod(0o444)  # the jail's user reads it through a bind mount, never writes it
        Path(host, "seccomp.bpf").write_bytes((mode != NO_JAIL and _seccomp_program()) or b"")
        with open(stdin_file, "rb") as stdin_handle, open(Path(host, "seccomp.bpf"), "rb") as seccomp:
            process = subprocess.Popen(
                _command(mode, str(solution), limits, args, seccomp.fileno()), cwd=host, stdin=stdin_handle,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin", "HOME": host},
                preexec_fn=_limit_resources(limits, mode == AS_NOBODY, group), start_new_session=True,
                pass_fds=(seccomp.fileno(),))
        try:
            stdout, stderr, stopped = _collect(process, limits, group)
        finally:
            _kill_tree(process, group)
            process.wait()
            process.stdout.close()
            process.stderr.close()
    if group is None:
        return Finished(process.returncode, stdout, stderr, stopped)
    return Finished(process.returncode, stdout, stderr, stopped, group.cpu_seconds(), group.killed_for_memory())


def _collect(process: subprocess.Popen, limits: Limits, group: RunGroup | None) -> tuple[bytes, bytes, str | None]:
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
            if group is not None and group.killed_for_memory():  # the verdict is in: no need to wait
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


CPU_POLL_S = 0.1


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


# The kernel ends a process over RLIMIT_CPU with SIGXCPU, then SIGKILL at the hard limit.
_CPU_SIGNALS = {-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL}


def run_python(code: str, stdin: str = "", limits: Limits = Limits()) -> str:
    """The solution's stdout; SandboxViolation when a limit stopped it, with the reason."""
    found = jail()
    finished = _run(found.mode, code, stdin, limits, accounted=found.protections["accounting"])
    if finished.stopped:
        raise SandboxViolation(finished.stopped)
    verdict = _limit_verdict(finished, limits)
    if verdict:
        raise SandboxViolation(verdict)
    return finished.stdout.decode(errors="replace")


def _limit_verdict(finished: Finished, limits: Limits) -> str | None:
    """Which limit ended the program, if one did. With a cgroup the kernel's own books say (its CPU
    time, its OOM kills): a program cannot fake a verdict. Without one, keel goes by how it ended
    (bwrap exits 128 + the signal), which a program can fake (exit 152, print MemoryError) to be
    not scored rather than wrong: that only takes it out of the update, and counts towards
    reward.max_not_scored_ratio."""
    if finished.cpu_s is not None:
        if finished.oom_killed:
            return f"memory limit: over {limits.memory_mb} MB"
        return f"cpu limit: over {limits.cpu_s} s of CPU" if finished.cpu_s >= 0.95 * limits.cpu_s else None
    if finished.returncode in _CPU_SIGNALS:
        return f"cpu limit: over {limits.cpu_s} s of CPU"
    if finished.returncode != 0 and b"MemoryError" in finished.stderr:
        return f"memory limit: over {limits.memory_mb} MB"
    return None


# Run inside a candidate jail: each protection checked from where the solution stands.
_PROBE = r'''
import json, os, socket, sys
trainer_pid, trainer_uid, trainer_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def refused(action):
    try:
        action()
    except OSError:
        return True
    return False
def in_init_user_namespace():
    return open("/proc/self/uid_map").read().split() == ["0", "0", "4294967295"]
print(json.dumps({
    "filesystem": not os.path.exists(trainer_dir) and refused(lambda: open("/keel_probe", "w")),
    "network": [name for _, name in socket.if_nameindex()] == ["lo"],
    "processes": refused(lambda: os.kill(trainer_pid, 0)),
    "user": os.getuid() != 0 and (os.getuid() != trainer_uid or not in_init_user_namespace()),
    "syscalls": refused(lambda: os.memfd_create("probe")),  # only the seccomp filter refuses it
}))
'''


PROBE_LIMITS = Limits(wall_s=60.0, cpu_s=10)


def _probe(mode: str) -> dict[str, bool] | str:
    """The protections a mode gives here, or why it cannot run."""
    try:
        finished = _run(mode, _PROBE, "", PROBE_LIMITS, [str(os.getpid()), str(os.getuid()),
                                                         os.path.realpath(os.getcwd())], accounted=False)
    except (OSError, ValueError, subprocess.SubprocessError) as error:
        return f"{mode}: {error}"
    if finished.stopped or finished.returncode != 0:  # bwrap says why on stderr (an old release, a refusal)
        said = finished.stderr.decode(errors="replace").strip().splitlines()
        return f"{mode}: " + (said[-1] if said else finished.stopped or f"exit status {finished.returncode}")
    try:
        checks = json.loads(finished.stdout)
    except ValueError:
        return f"{mode}: the probe's answer was unreadable"
    return {**checks, "limits": True, "accounting": _accounting_works(mode), "output": True}


def _accounting_works(mode: str) -> bool:
    """Whether a run can have a cgroup of its own here, tried end to end."""
    try:
        finished = _run(mode, "print(1)", "", PROBE_LIMITS, accounted=True)
    except (OSError, ValueError, subprocess.SubprocessError):  # the child could not join the group
        return False
    return finished.cpu_s is not None and finished.returncode == 0


NO_CGROUP = ("no cgroup keel may create for a run (cgroup v1 controllers it can write, or a cgroup v2 "
             "subtree with memory and pids delegated): per-process rlimits instead")


@lru_cache(maxsize=1)
def jail() -> Jail:
    """The strongest jail this machine gives, probed once per process: as uid 65534 when root,
    else (or when that is refused) in a user namespace, else no jail."""
    failures = []
    if shutil.which("bwrap") is None:
        failures.append("bubblewrap is not installed (apt-get install bubblewrap)")
    else:
        for mode in ([AS_NOBODY] if os.getuid() == 0 else []) + [IN_USER_NAMESPACE]:
            protections = _probe(mode)
            if isinstance(protections, dict):
                return Jail(mode, protections, "; ".join(failures + ([] if protections["accounting"] else [NO_CGROUP])))
            failures.append(protections)
    protections = _probe(NO_JAIL)
    if isinstance(protections, str):
        failures.append(protections)
        protections = {name: name in ("limits", "output") for name in PROTECTIONS}
    elif not protections["accounting"]:
        failures.append(NO_CGROUP)
    return Jail(NO_JAIL, protections, "; ".join(failures))


ISOLATION = ("filesystem", "network", "processes", "user")  # what reward.sandbox.require=isolation needs


def require_jail(required: str) -> Jail:
    """This machine's jail, before any model-written code runs. `reward.sandbox.require`: `all`
    protections, the `isolation` ones (the default: model code never runs unfenced), or `none`.
    Short of what is required, an error; short of the rest, a warning naming what is missing."""
    found = jail()
    if found.complete:
        return found
    message = f"the code sandbox runs without: {', '.join(found.missing())} ({found.why_not})"
    needed = {"all": list(PROTECTIONS), "isolation": ISOLATION, "none": ()}[required]
    if any(not found.protections[name] for name in needed):
        raise KeelError(SANDBOX_INCOMPLETE, f"{message}; reward.sandbox.require={required}")
    log.warning("%s; reward.sandbox.require=all refuses to run like this", message)
    return found
