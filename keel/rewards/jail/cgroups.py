"""A control group for one sandboxed run: limits and readings for the whole process tree.

Resource limits (rlimits) are per process and start again in every child, and they miss memory no
process maps: a tmpfs, a memfd, kernel memory for a million directories. A cgroup counts all of it,
for every process the run starts, and the kernel keeps the books: its CPU time and whether it was
killed for memory are read here, by keel, so a program cannot fake either verdict.

cgroup v2 (one tree) and v1 (a tree per controller, as in many containers) name the same things
differently; `Layout` holds the names. Creating groups needs write access to our own cgroup: root
in a container, or a delegated subtree. Without it, `create` returns None and the jail reports the
protection missing.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
log = logging.getLogger("keel")


@dataclass(frozen=True)
class Layout:
    # the directory of each controller's group (one directory in v2)
    memory: Path
    pids: Path
    cpu: Path
    v2: bool


def _own_group(controller: str, proc_cgroup: str) -> str | None:
    """This process's group in a v1 controller's hierarchy, or in v2's (controller "")."""
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") or (controller == "" and controllers == ""):
            return path
    return None


def layout(root: Path = ROOT, proc_cgroup: str | None = None) -> Layout | None:
    """Where a child of this process's own groups would go, or None without usable controllers."""
    proc_cgroup = proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text()
    # v2
    if (root / "cgroup.controllers").is_file():
        own = root / (_own_group("", proc_cgroup) or "/").lstrip("/")
        enabled = (
            (own / "cgroup.subtree_control").read_text().split()
            if (own / "cgroup.subtree_control").is_file()
            else []
        )
        return Layout(own, own, own, True) if {"memory", "pids"} <= set(enabled) else None
    groups = {c: _own_group(c, proc_cgroup) for c in ("memory", "pids", "cpuacct")}
    if any(g is None or not (root / c).is_dir() for c, g in groups.items()):
        return None
    # Without a cgroup namespace a container sees the host's path for its group, while its mount
    # shows that group as the root: there, the mount root is ours.
    dirs = [
        root / c / g.lstrip("/") if (root / c / g.lstrip("/")).is_dir() else root / c
        for c, g in groups.items()
    ]
    return Layout(*dirs, v2=False)


class RunGroup:
    """One run's group: created with its limits, joined by the run's first process before it
    execs, read when the run ends, then removed."""

    def __init__(self, where: Layout, memory_bytes: int, processes: int):
        self.where = where
        name = f"keel-sandbox-{uuid.uuid4().hex[:12]}"
        self.memory, self.pids, self.cpu = (
            base / name for base in (where.memory, where.pids, where.cpu)
        )
        # one directory in v2
        self.dirs = sorted({self.memory, self.pids, self.cpu})
        try:
            self._make(memory_bytes, processes)
        except OSError:
            # what was made of it
            self.remove()
            raise

    def _make(self, memory_bytes: int, processes: int) -> None:
        for directory in self.dirs:
            directory.mkdir()
        if self.where.v2:
            self._write(self.memory, "memory.max", memory_bytes)
            self._write(self.memory, "memory.swap.max", 0, optional=True)
        else:
            self._write(self.memory, "memory.limit_in_bytes", memory_bytes)
            # no swap
            self._write(self.memory, "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
        self._write(self.pids, "pids.max", processes)

    @staticmethod
    def _write(directory: Path, name: str, value: int, optional: bool = False) -> None:
        try:
            (directory / name).write_text(str(value))
        except OSError:
            if not optional:
                raise

    def procs_files(self) -> list[str]:
        """Where the run's first process writes its pid to join the group (launcher.py does, before
        it execs: everything it starts is in the group)."""
        return [str(directory / "cgroup.procs") for directory in self.dirs]

    def cpu_seconds(self) -> float:
        if self.where.v2:
            stat = dict(line.split() for line in (self.cpu / "cpu.stat").read_text().splitlines())
            return int(stat["usage_usec"]) / 1e6
        return int((self.cpu / "cpuacct.usage").read_text()) / 1e9

    def killed_for_memory(self) -> bool:
        name = "memory.events" if self.where.v2 else "memory.oom_control"
        events = dict(line.split() for line in (self.memory / name).read_text().splitlines())
        return int(events.get("oom_kill", 0)) > 0

    def kill(self) -> None:
        """SIGKILL to every process of the run, wherever it went: the group is the whole tree."""
        if not (self.pids / "cgroup.procs").exists():
            return
        for pid in (self.pids / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self) -> None:
        """Once its processes are gone; a group with processes cannot be removed, and the kernel
        takes a moment to reap a killed tree."""
        for _ in range(200):
            try:
                self.kill()
                for directory in self.dirs:
                    if directory.exists():
                        directory.rmdir()
                return
            except OSError:
                time.sleep(0.01)
        log.warning(
            "could not remove the sandbox cgroup %s: a process of the run is still in it",
            self.dirs[0],
        )


def create(memory_bytes: int, processes: int) -> RunGroup | None:
    """A group for one run, or None where this machine does not let keel make one."""
    try:
        where = layout()
        return RunGroup(where, memory_bytes, processes) if where else None
    except (OSError, ValueError):
        return None
