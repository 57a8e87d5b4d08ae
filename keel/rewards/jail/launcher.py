"""The first program of every jailed run: it sets the run's limits on itself, then execs bubblewrap
(or the interpreter). A fresh interpreter (`python -I -S launcher.py SPEC -- COMMAND...`), standard
library only, rather than a preexec_fn in the trainer's process: there, Python runs every
library's at-fork hooks before the preexec_fn, and one that starts a thread (OpenTelemetry's, once
mlflow is imported) leaves the child multithreaded, where the kernel refuses unshare(CLONE_NEWUSER).

SPEC is JSON: `report_fd` (where a failure to set up is written; closed on exec, so the trainer
reads nothing there once the command runs, and a program cannot write there), `cgroup_procs`
(files to write this process's pid to: the run's cgroup), `rlimits` ({name: value}, set soft and
hard: without CAP_SYS_RESOURCE in the initial user namespace, which the program never has, a hard
limit cannot be raised), `own_namespace` (enter a user namespace of the run's own first, where
RLIMIT_NPROC counts this run's processes only), `nproc`, `as_nobody` (root becomes uid 65534 with
no capabilities before the exec).

In a user namespace of its own, RLIMIT_NPROC caps the run's tree as a pids cgroup would: since
Linux 5.14 the kernel counts processes per user in each user namespace and checks every namespace
up the chain against the limit in force when it was made. Root maps every id to itself, so uid
65534 stays uid 65534 and bubblewrap, root in it, can still make its mounts; the kernel lets only a
process with CAP_SETUID over the parent namespace write such a map, so a helper forked before the
namespace is made writes it. Another user maps its own ids.
"""

import ctypes
import json
import os
import resource
import sys

CLONE_NEWUSER = 0x10000000
PR_SET_NO_NEW_PRIVS = 38
# the initial namespace's own map
EVERY_ID = "0 0 4294967295"
NOBODY = 65534
# as env(1) and timeout(1) say they failed before running the command
LAUNCH_FAILED = 125
_libc = ctypes.CDLL(None, use_errno=True)


def _unshare() -> None:
    if _libc.unshare(CLONE_NEWUSER) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"unshare(CLONE_NEWUSER): {os.strerror(error)}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def _map_from_helper() -> None:
    """Root's namespace, mapped identically by a helper left outside it."""
    made_r, made_w = os.pipe()
    # this interpreter registered no at-fork hooks
    helper = os.fork()
    if helper == 0:
        status = 1
        try:
            os.close(made_w)
            # nothing when the namespace could not be made
            if os.read(made_r, 1) == b"1":
                _write(f"/proc/{os.getppid()}/uid_map", EVERY_ID)
                _write(f"/proc/{os.getppid()}/gid_map", EVERY_ID)
                status = 0
        finally:
            os._exit(status)
    os.close(made_r)
    try:
        _unshare()
        os.write(made_w, b"1")
    finally:
        os.close(made_w)
        _, status = os.waitpid(helper, 0)
    if status != 0:
        raise OSError("could not map the ids of the run's user namespace")


def enter_own_namespace() -> None:
    uid, gid = os.getuid(), os.getgid()
    if uid == 0:
        _map_from_helper()
        return
    _unshare()
    # the kernel's condition for mapping one's own gid
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")


def become_nobody() -> None:
    """uid and gid 65534, no supplementary groups, no capabilities (the kernel clears them when
    root's uids all change), and no way back through a set-user-ID program."""
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


def apply(spec: dict) -> None:
    # first: everything this process starts is in the group
    for procs in spec.get("cgroup_procs", []):
        _write(procs, str(os.getpid()))
    for name, value in spec.get("rlimits", {}).items():
        # SIGXCPU at the soft limit, SIGKILL a second later
        hard = value + 1 if name == "RLIMIT_CPU" else value
        resource.setrlimit(getattr(resource, name), (value, hard))
    # counted apart from every other run
    if spec.get("own_namespace"):
        enter_own_namespace()
    if spec.get("nproc") is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))
    if spec.get("as_nobody"):
        become_nobody()


def launched(python: str, spec: dict, command: list[str]) -> list[str]:
    """The command line that runs `command` after this launcher applied `spec` (the trainer's
    side)."""
    return [python, "-I", "-S", os.path.abspath(__file__), json.dumps(spec), "--", *command]


def main(argv: list[str]) -> None:
    spec, separator, command = json.loads(argv[0]), argv[1], argv[2:]
    if separator != "--" or not command:
        sys.exit("usage: launcher.py SPEC -- COMMAND...")
    report = spec["report_fd"]
    # closed by the exec: the command never holds it
    os.set_inheritable(report, False)
    try:
        apply(spec)
        os.execvp(command[0], command)
    # the jail could not be set up, or the command not started
    except OSError as refused:
        os.write(report, str(refused).encode()[:4096])
        os._exit(LAUNCH_FAILED)


if __name__ == "__main__":
    main(sys.argv[1:])
