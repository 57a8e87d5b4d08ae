"""A user namespace of a run's own, so RLIMIT_NPROC caps that run's processes where no cgroup can.

RLIMIT_NPROC limits the processes (and threads) of one user. Since Linux 5.14 the kernel counts them
per user *in each user namespace*, and checks every namespace up the chain against the limit in
force when it was made. A run entered into a namespace of its own before the limit is set is
counted apart from every other run and from the trainer: the limit caps this run's tree, as a pids
cgroup would. Nothing comes with the namespace that lets the run lift a limit: raising a hard limit
or passing RLIMIT_NPROC needs CAP_SYS_RESOURCE in the initial namespace, which the run never holds.

Root maps every id to itself, so uid 65534 stays uid 65534 and bubblewrap, root in it, can still
make its mounts. The kernel lets only a process with CAP_SETUID over the parent namespace write such
a map, so a helper forked before the namespace is made writes it. Another user maps its own ids.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from functools import lru_cache

CLONE_NEWUSER = 0x10000000
EVERY_ID = "0 0 4294967295"  # the initial namespace's own map
_libc = ctypes.CDLL(None, use_errno=True)  # loaded here, not in the child between fork and exec


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
    # libc's fork, not os.fork: os.fork runs Python's at-fork hooks, and a library's hook that starts
    # a thread (OpenTelemetry's, imported with mlflow) waits forever in this single-threaded child.
    helper = _libc.fork()
    if helper < 0:
        raise OSError(ctypes.get_errno(), "fork for the id-map helper failed")
    if helper == 0:
        status = 1
        try:
            os.close(made_w)
            if os.read(made_r, 1) == b"1":  # nothing when the namespace could not be made
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


def enter() -> None:
    """Called in the run's first process between fork and exec; OSError when refused here."""
    uid, gid = os.getuid(), os.getgid()
    if uid == 0:
        _map_from_helper()
        return
    _unshare()
    _write("/proc/self/setgroups", "deny")  # the kernel's condition for mapping one's own gid
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")


@lru_cache(maxsize=1)
def available() -> bool:
    """Whether this machine lets a run have a user namespace of its own (containers often refuse
    one: a seccomp profile, user.max_user_namespaces = 0), tried once per process."""
    try:
        return subprocess.run([sys.executable, "-I", "-S", "-c", ""], preexec_fn=enter, timeout=60,
                              stdin=subprocess.DEVNULL, capture_output=True).returncode == 0
    except (OSError, subprocess.SubprocessError):  # enter() refused: "Exception occurred in preexec_fn"
        return False
