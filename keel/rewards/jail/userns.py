"""Whether this machine lets a jailed run have a user namespace of its own, where RLIMIT_NPROC caps
that run's processes as a pids cgroup would (launcher.py makes the namespace and says how)."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import lru_cache

from keel.rewards.jail.launcher import launched


@lru_cache(maxsize=1)
def available() -> bool:
    """Tried once per process: containers often refuse one (a seccomp profile,
    user.max_user_namespaces = 0)."""
    report_r, report_w = os.pipe()
    try:
        command = launched(
            sys.executable,
            {"report_fd": report_w, "own_namespace": True},
            [sys.executable, "-I", "-S", "-c", ""],
        )
        done = subprocess.run(
            command, pass_fds=(report_w,), timeout=60, stdin=subprocess.DEVNULL, capture_output=True
        )
        return done.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        os.close(report_r), os.close(report_w)
