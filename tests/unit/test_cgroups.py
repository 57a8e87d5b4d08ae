"""Where a sandboxed run's cgroup goes and what keel reads from it, on cgroup v1 and v2 layouts.
The kernel side is exercised by tests/unit/test_sandbox.py on this machine (v1); these trees are
written by hand so that v2's file names are checked too."""

from pathlib import Path

from keel.rewards.jail import cgroups

V1_PROC = "9:name=systemd:/\n8:pids:/\n4:memory:/job/7\n2:cpuacct,cpu:/\n0::/\n"
V2_PROC = "0::/user.slice/keel.scope\n"


def v2_tree(root: Path, delegated: str) -> Path:
    own = root / "user.slice" / "keel.scope"
    own.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    (own / "cgroup.subtree_control").write_text(delegated)
    return own


def test_v1_layout_follows_each_controllers_own_path(tmp_path):
    for controller in ("memory", "pids", "cpuacct"):
        (tmp_path / controller).mkdir()
    # A container without a cgroup namespace: the host's path is not under its mount, whose root is
    # its group
    assert cgroups.layout(tmp_path, V1_PROC).memory == tmp_path / "memory"
    (tmp_path / "memory/job/7").mkdir(parents=True)
    where = cgroups.layout(tmp_path, V1_PROC)
    assert not where.v2
    assert (where.memory, where.pids, where.cpu) == (
        tmp_path / "memory/job/7",
        tmp_path / "pids",
        tmp_path / "cpuacct",
    )
    # no v1 controllers named: no layout
    assert cgroups.layout(tmp_path, "0::/\n") is None


def test_v2_layout_needs_memory_and_pids_delegated(tmp_path):
    own = v2_tree(tmp_path, "cpu memory pids\n")
    assert cgroups.layout(tmp_path, V2_PROC) == cgroups.Layout(own, own, own, True)
    (own / "cgroup.subtree_control").write_text("cpu\n")
    assert cgroups.layout(tmp_path, V2_PROC) is None


def test_a_v2_run_group_writes_its_limits_and_reads_the_kernels_books(tmp_path):
    own = v2_tree(tmp_path, "memory pids\n")
    group = cgroups.RunGroup(cgroups.layout(tmp_path, V2_PROC), memory_bytes=1 << 28, processes=36)
    assert group.dirs == [group.memory] and group.memory.parent == own
    assert (group.memory / "memory.max").read_text() == str(1 << 28)
    assert (group.memory / "memory.swap.max").read_text() == "0"
    assert (group.pids / "pids.max").read_text() == "36"
    (group.cpu / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\n")
    (group.memory / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert group.cpu_seconds() == 2.5 and group.killed_for_memory()
