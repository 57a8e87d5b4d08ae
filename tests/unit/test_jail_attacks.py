"""Attacks on the code jail's user and limits: a solution that tries to be root, lift its own
limits, or start more processes than its cap. Each runs in this machine's jail (with its cgroup)
and again as a machine without writable cgroups runs it (RLIMIT_NPROC in a user namespace of the
run's own), and without bubblewrap as root drops it to uid 65534. Each test asserts the attack was
contained on the host, and that an ordinary program still runs and prints after it."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from keel.rewards.jail import userns
from keel.rewards.jail.bwrap import (
    IN_USER_NAMESPACE,
    NO_JAIL_AS_NOBODY,
    Limits,
    _interpreter,
    run_jailed,
)
from keel.rewards.jail.sandbox import SandboxViolation, jail, limit_verdict

LIMITS = Limits(cpu_s=3, wall_s=30, memory_mb=128, processes=16)
# run_jailed's `accounted`
HOW = {"cgroup": True, "own user namespace": False}


def run(code: str, accounted: bool, limits: Limits = LIMITS, args: list[str] = ()) -> str:
    """The program's output in this machine's jail; SandboxViolation when a limit stopped it."""
    finished = run_jailed(jail().mode, code, "", limits, list(args), accounted=accounted)
    verdict = finished.stopped or limit_verdict(finished, limits)
    if verdict:
        raise SandboxViolation(verdict)
    return finished.stdout.decode()


def still_runs(accounted: bool) -> None:
    assert (
        run(
            "import threading\nthreading.Thread(target=print, args=(6 * 7,)).start()", accounted
        ).strip()
        == "42"
    )


@pytest.fixture(params=list(HOW), autouse=False)
def accounted(request):
    if not HOW[request.param] and not userns.available():
        pytest.skip("this machine gives no user namespace of a run's own")
    return HOW[request.param]


WHO_AM_I = textwrap.dedent(
    """
    import json, os
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    escalated = []
    for name, attempt in [("setuid", lambda: os.setuid(0)), ("setgid", lambda: os.setgid(0)),
                          ("setgroups", lambda: os.setgroups([0])),
                          ("chmod a file of root's", lambda: os.chmod("/dev/null", 0o666))]:  """
    """# its mode already
        try:
            attempt()
            escalated.append(name)
        except OSError:
            pass
    print(json.dumps({"uid": os.getuid(), "euid": os.geteuid(), "cap_eff": """
    """int(status["CapEff"], 16),
                      "cap_prm": int(status["CapPrm"], 16), "escalated": escalated}))
"""
)


def test_the_program_is_not_root_and_holds_no_capability(accounted):
    seen = json.loads(run(WHO_AM_I, accounted))
    assert seen["uid"] != 0 and seen["euid"] != 0
    assert seen["cap_eff"] == 0 and seen["cap_prm"] == 0
    assert seen["escalated"] == []
    still_runs(accounted)


LIFT_LIMITS = textwrap.dedent("""
    import resource
    for name in ("RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_CPU", "RLIMIT_NOFILE", "RLIMIT_FSIZE"):
        limit = getattr(resource, name)
        soft, hard = resource.getrlimit(limit)
        if hard == resource.RLIM_INFINITY:  # nothing to lift (memory is the cgroup's to bound)
            continue
        try:
            resource.setrlimit(limit, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            print("LIFTED", name)
        except (OSError, ValueError):
            pass
""")
MAP_2_GIB = LIFT_LIMITS + textwrap.dedent("""
    import mmap
    try:
        block = mmap.mmap(-1, 2 << 30)
        for offset in range(0, 2 << 30, 4096):  # every page touched: the memory is really taken
            block[offset] = 1
        print("MAPPED 2 GiB")
    except (OSError, MemoryError):
        print("map refused")
""")


def test_it_cannot_lift_its_limits_and_map_2_gib(accounted):
    # no LIFTED line
    assert run(LIFT_LIMITS + "print('tried')", accounted).split() == ["tried"]
    try:
        out = run(MAP_2_GIB, accounted)
    # the cgroup's memory limit killed it while it touched the pages
    except SandboxViolation as stopped:
        assert "memory limit" in str(stopped)
    # RLIMIT_AS refused the mapping
    else:
        assert out.split("\n")[:1] == ["map refused"]
    still_runs(accounted)


def count_forks(n: int) -> str:
    """Starts n children that wait on a pipe; prints how many got through, then lets them go."""
    return textwrap.dedent(f"""
        import os, sys
        gate, release = os.pipe()
        started = 0
        for _ in range({n}):
            try:
                if os.fork() == 0:
                    os.close(release)
                    os.read(gate, 1)
                    os._exit(0)
            except OSError:
                break
            started += 1
        print(started, flush=True)
        os.close(release)
        for _ in range(started):
            os.wait()
    """)


def test_200_forks_stop_at_the_cap(accounted):
    started = int(run(count_forks(200), accounted))
    # the program itself is one of its processes
    assert 0 < started < LIMITS.processes
    still_runs(accounted)


def _processes_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_fork_bomb_is_capped_and_leaves_nothing(accounted):
    # in every process's command line: the bomb's children are findable
    marker = f"bomb-{uuid.uuid4().hex}"
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    with pytest.raises(SandboxViolation) as info:
        run(bomb, accounted, Limits(cpu_s=2, wall_s=10, memory_mb=128, processes=8), [marker])
    assert "cpu limit" in str(info.value) or "timeout" in str(info.value)
    # without a cgroup the kernel tears the pid namespace down after the run returns
    for _ in range(200):
        if not _processes_with(marker):
            break
        time.sleep(0.05)
    assert _processes_with(marker) == []
    still_runs(accounted)


def test_the_machine_says_how_its_processes_are_capped():
    found = jail()
    assert found.protections["user"] and found.protections["process count"], found.summary()
    assert "runs as uid 65534 without capabilities" in found.summary()
    assert f"process count capped by {found.process_cap}" in found.summary() and found.process_cap


def _python_nobody_can_run() -> str | None:
    """A Python with keel's requirements whose interpreter uid 65534 can run (one under /root is
    not)."""
    for python in (sys.executable, "/usr/bin/python3"):
        base = Path(_interpreter()[0] if python == sys.executable else os.path.realpath(python))
        reachable = all(os.stat(part).st_mode & 0o001 for part in [*base.parents, base])
        if (
            reachable
            and subprocess.run([python, "-c", "import yaml"], capture_output=True).returncode == 0
        ):
            return python
    return None


TRAINER_PYTHON = _python_nobody_can_run()
AS_A_ROOT_TRAINER = textwrap.dedent(
    """
    import json, sys
    sys.modules["pyseccomp"] = None
    from keel.rewards.jail.bwrap import Limits, run_jailed
    from keel.rewards.jail.sandbox import jail
    mode, code, out = sys.argv[1], sys.argv[2], {}
    if mode == "probe":
        found = jail()
        print(json.dumps({"mode": found.mode, "missing": found.missing(), "summary": """
    """found.summary()}))
        sys.exit()
    done = run_jailed(mode, code, "", Limits(cpu_s=3, wall_s=30, memory_mb=128, processes=16), """
    """accounted=False)
    print(json.dumps({"returncode": done.returncode, "stdout": done.stdout.decode(), "stderr": """
    """done.stderr.decode()}))
"""
)


def as_root_trainer(mode: str, code: str = "", path: str = "/usr/bin:/bin") -> dict:
    """A root trainer on a Python that uid 65534 can run."""
    done = subprocess.run(
        [TRAINER_PYTHON, "-c", AS_A_ROOT_TRAINER, mode, code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/tmp",
        env={"PATH": path, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


needs_root_and_system_python = pytest.mark.skipif(
    os.getuid() != 0 or TRAINER_PYTHON is None or not userns.available(),
    reason="needs root, a Python with keel's requirements that uid 65534 can run, and user "
    "namespaces",
)


@needs_root_and_system_python
def test_without_bubblewrap_root_still_runs_the_program_as_nobody(tmp_path):
    """A machine without bubblewrap (the GPU image) isolates nothing, but root drops to uid 65534
    with no capability, hard limits and a capped process count; keel doctor names what is
    missing."""
    # no bwrap on this PATH
    probe = as_root_trainer("probe", path="/usr/local/bin")
    assert probe["mode"] == NO_JAIL_AS_NOBODY
    assert {"filesystem", "network"} <= set(probe["missing"]) and "user" not in probe["missing"]
    assert "process count" not in probe["missing"] and "limits" not in probe["missing"]
    # the trainer's own directory
    os.chmod(tmp_path, 0o700)
    attack = (
        WHO_AM_I
        + f"\ntry:\n    open({str(tmp_path)!r} + '/escaped', 'w')\n    print('WROTE')\nexcept "
        "OSError:\n    pass\n"
    )
    seen = json.loads(as_root_trainer(NO_JAIL_AS_NOBODY, attack)["stdout"].splitlines()[0])
    assert seen["uid"] == 65534 and seen["cap_eff"] == 0 and seen["escalated"] == []
    assert list(tmp_path.iterdir()) == []
    assert as_root_trainer(NO_JAIL_AS_NOBODY, MAP_2_GIB)["stdout"] == "map refused\n"
    assert 0 < int(as_root_trainer(NO_JAIL_AS_NOBODY, count_forks(200))["stdout"]) < 16
    assert as_root_trainer(NO_JAIL_AS_NOBODY, "print('still runs')")["stdout"] == "still runs\n"


@needs_root_and_system_python
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_bubblewrap_in_a_user_namespace_never_maps_the_program_to_root():
    """Root's fallback when bubblewrap cannot run as root (no setpriv): it drops to uid 65534 first,
    so the program's uid is not root's outside the namespace, and RLIMIT_NPROC holds."""
    seen = json.loads(as_root_trainer(IN_USER_NAMESPACE, WHO_AM_I)["stdout"])
    assert seen["uid"] == 65534 and seen["cap_eff"] == 0 and seen["escalated"] == []
    assert 0 < int(as_root_trainer(IN_USER_NAMESPACE, count_forks(200))["stdout"]) < 16


AT_FORK_THREAD = textwrap.dedent(
    """
    import os, threading, time
    script = os.getpid()
    def start_a_thread_or_hang():  # as a library's hook may (OpenTelemetry's, imported with mlflow)
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        if os.getppid() != script:
            time.sleep(3600)
    os.register_at_fork(after_in_child=start_a_thread_or_hang)
    threading.Thread(target=threading.Event().wait, daemon=True).start()  # a trainer has threads
    from keel.rewards.jail import userns
    from keel.rewards.jail.bwrap import Limits, run_jailed
    from keel.rewards.jail.sandbox import jail
    print(userns.available())  # the run's own namespace, with the hook's thread in every fork
    for accounted in (True, False):
        finished = run_jailed(jail().mode, "print(6 * 7)", "", """
    """Limits(cpu_s=3, wall_s=30, memory_mb=128,
                                                                        processes=16), """
    """accounted=accounted)
        print(finished.stdout.decode().strip())
"""
)


def test_a_library_hook_that_starts_a_thread_after_fork_does_not_break_a_run():
    """Python runs every at-fork hook in a child it forks before a preexec_fn; a hook that starts a
    thread there (seen in this suite once mlflow had loaded OpenTelemetry) leaves the child
    multithreaded, where the kernel refuses a user namespace, and one that waits can hang. The jail
    is set up by a launcher of its own (a fresh interpreter), so no hook of the trainer's runs."""
    clean = subprocess.run(
        [sys.executable, "-c", "from keel.rewards.jail import userns; print(userns.available())"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    done = subprocess.run(
        [sys.executable, "-c", AT_FORK_THREAD], capture_output=True, text=True, timeout=300
    )
    assert done.stdout.split() == [clean.stdout.strip(), "42", "42"], done.stderr


def test_a_jail_that_cannot_be_set_up_is_an_error_not_a_program_that_failed(monkeypatch):
    """The launcher's failure comes back as an error the scorer reports, never as a run whose
    program printed nothing (a silent score of 0); a program exiting with the launcher's code is
    only a program that failed."""
    from keel.rewards.jail import bwrap, launcher

    program = run_jailed(
        jail().mode, f"import sys\nsys.exit({launcher.LAUNCH_FAILED})", "", LIMITS, accounted=False
    )
    assert program.returncode == launcher.LAUNCH_FAILED and program.stopped is None
    spec = bwrap._launch_spec
    monkeypatch.setattr(
        bwrap, "_launch_spec", lambda *args: {**spec(*args), "cgroup_procs": ["/nonexistent/procs"]}
    )
    with pytest.raises(OSError, match="could not be set up"):
        run_jailed(jail().mode, "print(1)", "", LIMITS, accounted=False)
