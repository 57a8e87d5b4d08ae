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
import shutil
import signal
import subprocess
from dataclasses import dataclass
from functools import lru_cache

from keel.errors import SANDBOX_INCOMPLETE, KeelError
from keel.errors.fixes import setting
from keel.rewards.bwrap import AS_NOBODY, IN_USER_NAMESPACE, NO_JAIL, Finished, Limits, run_jailed

log = logging.getLogger("keel")


class SandboxViolation(Exception):
    """The solution was stopped by a limit (time, CPU, memory, output). Not scored."""


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


# The kernel ends a process over RLIMIT_CPU with SIGXCPU, then SIGKILL at the hard limit.
_CPU_SIGNALS = {-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL}


def run_python(code: str, stdin: str = "", limits: Limits = Limits()) -> str:
    """The solution's stdout; SandboxViolation when a limit stopped it, with the reason."""
    found = jail()
    finished = run_jailed(found.mode, code, stdin, limits, accounted=found.protections["accounting"])
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


# The probe runs without a cgroup, so RLIMIT_NPROC would count every process uid 65534 has on the
# machine (other runs, other trainers): a limit only a fork bomb reaches.
PROBE_LIMITS = Limits(wall_s=60.0, cpu_s=10, processes=4096)


def _probe(mode: str) -> dict[str, bool] | str:
    """The protections a mode gives here, or why it cannot run."""
    try:
        finished = run_jailed(mode, _PROBE, "", PROBE_LIMITS, [str(os.getpid()), str(os.getuid()),
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
        finished = run_jailed(mode, "print(1)", "", PROBE_LIMITS, accounted=True)
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


def _jail_fix(found: Jail) -> str:
    """What this machine can give: the isolation level when it has that; else bubblewrap, else namespaces."""
    if all(found.protections[name] for name in ISOLATION):
        return (f"set {setting('reward.sandbox.require', 'isolation')} (every isolation protection holds here; "
                f"missing: {', '.join(found.missing())})")
    how = ("install bubblewrap: `apt-get install bubblewrap`" if shutil.which("bwrap") is None else
           "run where user and mount namespaces are allowed (a VM, or a container with --security-opt "
           "seccomp=unconfined)")
    return f"{how}; or {setting('reward.sandbox.require', 'none')} runs model code unfenced, at your risk"


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
        raise KeelError(SANDBOX_INCOMPLETE, f"{message}; reward.sandbox.require={required}", _jail_fix(found))
    log.warning("%s; reward.sandbox.require=all refuses to run like this", message)
    return found
