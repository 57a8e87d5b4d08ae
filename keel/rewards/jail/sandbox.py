"""Run untrusted Python (a model's solution) in an operating-system jail.

The jail is bubblewrap (`bwrap`, Debian's `bubblewrap`), the sandbox Flatpak runs apps in:
- its own pid, network, IPC and UTS namespaces: the solution cannot see or signal the trainer,
  reaches no network (not even loopback), and everything it starts dies with it;
- its own mount namespace holding only the system's programs and libraries and the interpreter,
  read-only, plus a size-limited scratch directory in memory (`/sandbox`, its working directory):
  no path on the host is writable, and no project file, dataset or home directory is visible;
- an unprivileged user without capabilities: uid 65534 (`nobody`), dropped to by root inside the
  jail,
  or mapped in a user namespace for any other user; every rlimit set hard, so it cannot raise one;
- a seccomp filter refusing new namespaces, keyrings and kernel interfaces a judge never needs;
- a cgroup per run (keel/rewards/jail/cgroups.py) bounding the whole tree's memory, processes and
  CPU
  time, whose books give the CPU and memory verdicts; rlimits on top (open files, file size);
- its process count capped: the cgroup's pids.max, or where no cgroup can be had RLIMIT_NPROC in a
  user namespace of the run's own (keel/rewards/jail/launcher.py), which counts that run's processes
  only;
- output read as it comes and cut at the limit, and a wall-clock kill of the whole tree.
A machine that cannot give some of these (no bubblewrap, namespaces or cgroups refused, as in some
containers) runs solutions with what it has: `jail()` says which protections hold, `keel doctor`
and `keel check` print them, and `reward.sandbox.require` says what a run needs (isolation by
default, or all, or none).

What the solution does inside is its own business: a refused write or connection is an error in
the program, so the test case fails, as on a judge. Only the limits (time, CPU, output, memory)
stop a program without a verdict: SandboxViolation, and the sample is not scored.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from functools import lru_cache

from keel.errors import SANDBOX_INCOMPLETE, KeelError
from keel.errors.fixes import setting
from keel.rewards.jail import userns
from keel.rewards.jail.bwrap import (
    AS_NOBODY,
    IN_USER_NAMESPACE,
    NO_JAIL,
    NO_JAIL_AS_NOBODY,
    SANDBOX_UID,
    Finished,
    Limits,
    run_jailed,
)

log = logging.getLogger("keel")


class SandboxViolation(Exception):
    """The solution was stopped by a limit (time, CPU, memory, output). Not scored."""


# What each protection means, in the words `keel doctor` prints.
PROTECTIONS = {
    "filesystem": "read-only system directories only; writes go to a private in-memory "
    "scratch directory",
    "network": "no network (a network namespace of its own)",
    "processes": "cannot see or signal the trainer; every process it starts dies with it "
    "(a pid namespace)",
    "user": f"an unprivileged user without capabilities (uid {SANDBOX_UID}; checked inside: uid, "
    "CapEff, CapPrm)",
    "syscalls": "no new namespaces, keyrings or other kernel interfaces a judge never needs "
    "(seccomp)",
    "limits": "CPU time, open files and file size limited per process by hard rlimits the program "
    "cannot raise (address space too where no cgroup bounds memory)",
    "process count": "its processes and threads capped, so a fork bomb stops (cgroup pids.max, or "
    "RLIMIT_NPROC in a user namespace of the run's own)",
    "accounting": "memory (tmpfs, memfd and kernel memory too), processes and CPU time limited "
    "for the whole tree by a cgroup, whose books give the verdict (a program cannot "
    "fake a limit)",
    "output": "output read as it comes and cut at the limit; the whole tree killed at the "
    "wall-clock limit",
}


# Who the program runs as in each mode, where the "user" protection holds.
RUNS_AS = {
    AS_NOBODY: f"uid {SANDBOX_UID} without capabilities (bubblewrap as root, setpriv inside)",
    IN_USER_NAMESPACE: f"uid {SANDBOX_UID} without capabilities, in a user namespace",
    NO_JAIL_AS_NOBODY: f"uid {SANDBOX_UID} without capabilities",
    NO_JAIL: "the trainer's own user",
}
BY_CGROUP = "cgroup pids.max"
BY_OWN_NAMESPACE = "RLIMIT_NPROC in a user namespace of the run's own"
BY_SHARED_UID = f"RLIMIT_NPROC of uid {SANDBOX_UID}, shared by every run on this machine"


@dataclass(frozen=True)
class Jail:
    # AS_NOBODY | IN_USER_NAMESPACE | NO_JAIL_AS_NOBODY | NO_JAIL
    mode: str
    # PROTECTIONS -> in force here
    protections: dict[str, bool]
    # when some are missing: what stopped them
    why_not: str
    # what caps the process count here (BY_*), empty when nothing does
    process_cap: str = ""

    @property
    def complete(self) -> bool:
        return all(self.protections.values())

    def missing(self) -> list[str]:
        return [name for name, held in self.protections.items() if not held]

    def runs_as(self) -> str:
        """Who model-written code runs as here, in the words of the summary."""
        if self.protections.get("user"):
            return RUNS_AS.get(self.mode, f"uid {SANDBOX_UID} without capabilities")
        return "a user that holds capabilities or is the trainer's own (no unprivileged user)"

    def caps_processes(self) -> str:
        if self.protections.get("process count"):
            how = f" by {self.process_cap}" if self.process_cap else ""
            return (
                f"process count capped{how} (at most {Limits().processes} processes and threads a "
                "run)"
            )
        return "process count not capped"

    def summary(self) -> str:
        """One line for `keel doctor` and `keel check`: what is missing, who the program runs as and
        what caps its processes."""
        facts = f"runs as {self.runs_as()}; {self.caps_processes()}"
        if self.complete:
            return (
                f"{self.mode}: every protection in force ({', '.join(self.protections)}); {facts}"
            )
        return (
            f"{self.mode}: model-written code runs without {', '.join(self.missing())} "
            f"({self.why_not}); {facts}"
        )

    def describe(self) -> list[str]:
        how = {"user": self.runs_as(), "process count": self.caps_processes()}
        return [
            f"[{'ok' if held else 'MISSING'}] {name}: {PROTECTIONS[name]}"
            + (f" -- here: {how[name]}" if name in how else "")
            for name, held in self.protections.items()
        ]


# The kernel ends a process over RLIMIT_CPU with SIGXCPU, then SIGKILL at the hard limit.
_CPU_SIGNALS = {-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL}


# frozen, safe to share
def run_python(code: str, stdin: str = "", limits: Limits = Limits()) -> str:  # noqa: B008
    """The solution's stdout; SandboxViolation when a limit stopped it, with the reason."""
    found = jail()
    finished = run_jailed(
        found.mode, code, stdin, limits, accounted=found.protections["accounting"]
    )
    if finished.stopped:
        raise SandboxViolation(finished.stopped)
    verdict = limit_verdict(finished, limits)
    if verdict:
        raise SandboxViolation(verdict)
    return finished.stdout.decode(errors="replace")


def limit_verdict(finished: Finished, limits: Limits) -> str | None:
    """Which limit ended the program, if one did. With a cgroup the kernel's own books say (its CPU
    time, its OOM kills): a program cannot fake a verdict. Without one, keel goes by how it ended
    (bwrap exits 128 + the signal), which a program can fake (exit 152, print MemoryError) to be
    not scored rather than wrong: that only takes it out of the update, and counts towards
    reward.max_not_scored_ratio."""
    if finished.cpu_s is not None:
        if finished.oom_killed:
            return f"memory limit: over {limits.memory_mb} MB"
        return (
            f"cpu limit: over {limits.cpu_s} s of CPU"
            if finished.cpu_s >= 0.95 * limits.cpu_s
            else None
        )
    if finished.returncode in _CPU_SIGNALS:
        return f"cpu limit: over {limits.cpu_s} s of CPU"
    if finished.returncode != 0 and b"MemoryError" in finished.stderr:
        return f"memory limit: over {limits.memory_mb} MB"
    return None


# Run inside a candidate jail: each protection checked from where the solution stands.
_PROBE_TOOLS = (
    r"""
import json, os, resource, socket, sys
trainer_pid, trainer_uid, trainer_dir, cap = int(sys.argv[1]), int(sys.argv[2]), """
    r"""sys.argv[3], int(sys.argv[4])
def refused(action):
    try:
        action()
    except (OSError, ValueError):  # setrlimit says ValueError for EPERM
        return True
    return False
def status(field):
    return int(next(line.split()[1] for line in open("/proc/self/status") """
    r"""if line.startswith(field + ":")), 16)
def processes_started():
    gate, release = os.pipe()
    started = 0
    for _ in range(cap + 8):
        try:
            if os.fork() == 0:
                os.close(release)
                os.read(gate, 1)
                os._exit(0)
        except OSError:
            break
        started += 1
    os.close(release)
    for _ in range(started):
        os.wait()
    return started
"""
)
_PROBE = (
    _PROBE_TOOLS
    + r"""
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
print(json.dumps({
    "filesystem": not os.path.exists(trainer_dir) and refused(lambda: open("/keel_probe", "w")),
    "network": [name for _, name in socket.if_nameindex()] == ["lo"],
    "processes": refused(lambda: os.kill(trainer_pid, 0)),
    # Owning root's files (its uid mapped to root outside a user namespace) is root's power over
    # them: changing /dev/null's mode to what it is already tells, and changes nothing.
    "user": (os.getuid() != 0 and status("CapEff") == status("CapPrm") == 0
             and refused(lambda: os.chmod("/dev/null", 0o666))
             and not (os.getuid() == trainer_uid and os.path.exists(trainer_dir))),
    "syscalls": refused(lambda: os.memfd_create("probe")),  # only the seccomp filter refuses it
    "limits": refused(lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard + 1))),
    "process count": processes_started() < cap,  # the probe itself is one of the cap
}))
"""
)


PROBE_LIMITS = Limits(wall_s=60.0, cpu_s=10, processes=12)


def _probe(mode: str) -> dict[str, bool] | str:
    """The protections a mode gives here, or why it cannot run. The probe runs without a cgroup:
    what caps its processes is what a run has where no cgroup can be had."""
    args = [
        str(os.getpid()),
        str(os.getuid()),
        os.path.realpath(os.getcwd()),
        str(PROBE_LIMITS.processes),
    ]
    try:
        finished = run_jailed(mode, _PROBE, "", PROBE_LIMITS, args, accounted=False)
    except (OSError, ValueError, subprocess.SubprocessError) as error:
        return f"{mode}: {error}"
    # bwrap says why on stderr (an old release, a refusal)
    if finished.stopped or finished.returncode != 0:
        said = finished.stderr.decode(errors="replace").strip().splitlines()
        return f"{mode}: " + (
            said[-1] if said else finished.stopped or f"exit status {finished.returncode}"
        )
    try:
        checks = json.loads(finished.stdout)
    except ValueError:
        return f"{mode}: the probe's answer was unreadable"
    accounting = _accounting_works(mode)
    return {
        **checks,
        "process count": checks["process count"] or accounting,
        "accounting": accounting,
        "output": True,
    }


# how many children got through
_COUNT_PROCESSES = _PROBE_TOOLS + "print(processes_started())\n"


def _accounting_works(mode: str) -> bool:
    """Whether a run can have a cgroup of its own here, tried end to end: the kernel's books read,
    and its pids.max holding."""
    try:
        finished = run_jailed(
            mode, _COUNT_PROCESSES, "", PROBE_LIMITS, ["0", "0", "", str(PROBE_LIMITS.processes)]
        )
    # the child could not join the group
    except (OSError, ValueError, subprocess.SubprocessError):
        return False
    return (
        finished.cpu_s is not None
        and finished.returncode == 0
        and int(finished.stdout or b"-1") < PROBE_LIMITS.processes
    )


NO_CGROUP = (
    "no cgroup keel may create for a run (cgroup v1 controllers it can write, or a cgroup v2 "
    "subtree with memory and pids delegated): per-process rlimits instead"
)


def _process_cap(found: dict[str, bool]) -> str:
    """What caps a run's processes here, as `run_jailed` will choose it."""
    if found["accounting"]:
        return BY_CGROUP
    if not found["process count"]:
        return ""
    return BY_OWN_NAMESPACE if userns.available() else BY_SHARED_UID


NO_PROCESS_CAP = (
    "nothing caps a run's process count: no cgroup, and no user namespace of its own in which "
    "RLIMIT_NPROC would count only its processes"
)


NO_SECCOMP = (
    "no seccomp filter inside the jail (it needs pyseccomp and libseccomp: pip install pyseccomp)"
)


def _shortfalls(protections: dict[str, bool]) -> list[str]:
    return [
        why
        for name, why in (
            ("accounting", NO_CGROUP),
            ("process count", NO_PROCESS_CAP),
            ("syscalls", NO_SECCOMP),
        )
        if not protections[name]
    ]


@lru_cache(maxsize=1)
def jail() -> Jail:
    """The strongest jail this machine gives, probed once per process: bubblewrap as root, dropping
    to uid 65534 inside; else bubblewrap in a user namespace; else no jail, as uid 65534 where root
    can drop to it (the interpreter must be readable by that user), else as the trainer's user."""
    root = os.getuid() == 0
    failures, modes = [], ([AS_NOBODY] if root else []) + [IN_USER_NAMESPACE]
    if shutil.which("bwrap") is None:
        failures, modes = ["bubblewrap is not installed (apt-get install bubblewrap)"], []
    for mode in modes + ([NO_JAIL_AS_NOBODY] if root else []) + [NO_JAIL]:
        protections = _probe(mode)
        if isinstance(protections, dict):
            return Jail(
                mode,
                protections,
                "; ".join(failures + _shortfalls(protections)),
                _process_cap(protections),
            )
        failures.append(protections)
    return Jail(NO_JAIL, {name: name == "output" for name in PROTECTIONS}, "; ".join(failures))


# reward.sandbox.require=isolation
ISOLATION = ("filesystem", "network", "processes", "user", "process count")


def _jail_fix(found: Jail) -> str:
    """What this machine can give: the isolation level when it has that; else bubblewrap, else
    namespaces."""
    if all(found.protections[name] for name in ISOLATION):
        return (
            f"set {setting('reward.sandbox.require', 'isolation')} (every isolation protection "
            f"holds here; missing: {', '.join(found.missing())})"
        )
    how = (
        "install bubblewrap: `apt-get install bubblewrap`"
        if shutil.which("bwrap") is None
        else "run where user and mount namespaces are allowed (a VM, or a container with "
        "--security-opt seccomp=unconfined)"
    )
    return (
        f"{how}; or {setting('reward.sandbox.require', 'none')} runs model code unfenced, at your "
        "risk"
    )


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
        raise KeelError(
            SANDBOX_INCOMPLETE, f"{message}; reward.sandbox.require={required}", _jail_fix(found)
        )
    log.warning("%s; reward.sandbox.require=all refuses to run like this", message)
    return found
