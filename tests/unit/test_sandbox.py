"""Model-written code runs in an operating-system jail. Each attack below is one an RL-trained model
finds; each test asserts that the attack's effect did not happen on the host, not only that the
program failed: no file written or read outside, no connection made, no process left behind, the
trainer alive, its memory unharmed by a flood of output."""

import json
import os
import resource
import socket
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from keel.rewards.jail.sandbox import Limits, SandboxViolation, jail, run_python
from keel.rewards.reward_fn import RewardScorer
from keel.rewards.verl.code_tests import code_exec, extract_code

TESTS = json.dumps([{"input": "2 3\n", "output": "5"}, {"input": "10 -4\n", "output": "6"}])
LIMITS = Limits(cpu_s=2, wall_s=20, memory_mb=256)


def test_this_machine_gives_every_protection():
    """make install puts bubblewrap on the machine; without it the attacks below would succeed."""
    assert jail().complete, "\n".join(jail().describe()) + f"\n{jail().why_not}"


def test_a_correct_program_passes_and_a_wrong_one_scores_zero():
    good = "Here you go:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert code_exec("codecontests", good, TESTS) == 1.0
    # passes one of two
    assert code_exec("codecontests", "```python\nprint(5)\n```", TESTS) == 0.5
    # a crash is a wrong answer
    assert code_exec("codecontests", "raise SystemExit(1)", TESTS) == 0.0
    assert extract_code("no fences") == "no fences"


def test_a_program_may_use_its_scratch_directory_and_threads():
    program = textwrap.dedent(
        """
        import threading, subprocess
        open("notes.txt", "w").write("kept")
        threading.Thread(target=print, args=("thread",)).start()
        print(open("notes.txt").read(), subprocess.run(["echo", "child"], """
        """capture_output=True, text=True).stdout)
    """
    )
    assert run_python(program, "", LIMITS).split() == ["thread", "kept", "child"]


@pytest.mark.parametrize(
    "program, reason",
    [
        ("while True:\n    pass", "cpu limit"),
        ("x = bytearray(10 ** 10)", "memory limit"),
        ("import time\ntime.sleep(600)", "timeout"),
        ("print('x' * 10 ** 6)", "output limit"),
        ("import sys\nwhile True:\n    sys.stderr.write('y' * 4096)", "output limit"),
    ],
)
def test_limits_stop_a_program_without_a_verdict(program, reason):
    limits = Limits(cpu_s=2, wall_s=3 if "sleep" in program else 60, memory_mb=256)
    with pytest.raises(SandboxViolation) as info:
        run_python(program, "", limits)
    assert reason in str(info.value)


# every call that takes a destination path; each aims at the host directory given
WRITES = [
    "open(T + '/w1', 'w').write('x')",
    "os.close(os.open(T + '/w2', os.O_CREAT | os.O_WRONLY))",
    "os.mkdir(T + '/w3')",
    "os.makedirs(T + '/w4/deep')",
    "os.symlink('/etc/passwd', T + '/w5')",
    "os.link('solution.py', T + '/w6')",
    "os.rename('notes', T + '/w7')",
    "os.replace('notes', T + '/w8')",
    "shutil.copy('solution.py', T + '/w9')",
    "shutil.move('notes', T + '/w10')",
    "pathlib.Path(T, 'w11').write_bytes(b'x')",
    "os.mkfifo(T + '/w12')",
    "os.truncate(T + '/data.parquet', 0)",
    "open(T + '/data.parquet', 'a').write('tampered')",
    "os.remove(T + '/data.parquet')",
    "os.chmod(T + '/data.parquet', 0o777)",
    "os.utime(T + '/data.parquet', (0, 0))",
    "shutil.rmtree(T)",
    "open('/usr/keel_escaped', 'w')",
    "open('/keel_escaped', 'w')",
    "os.mkdir('/proc/keel_escaped')",
]


def test_writes_outside_the_scratch_directory_fail_by_every_path(tmp_path):
    data = tmp_path / "data.parquet"
    data.write_text("the trainer's data")
    stamp = data.stat()
    attempts = "\n".join(
        f"try:\n    {w}\n    print('WROTE', {w!r})\nexcept OSError:\n    pass" for w in WRITES
    )
    program = (
        f"import os, shutil, pathlib\nT = {str(tmp_path)!r}\nopen('notes', "
        f"'w').write('n')\n{attempts}\n"
    )
    out = run_python(program, "", LIMITS)
    assert "WROTE" not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.parquet"]
    assert data.read_text() == "the trainer's data" and data.stat().st_mtime == stamp.st_mtime
    assert not os.path.exists("/usr/keel_escaped") and not os.path.exists("/keel_escaped")


def test_nothing_outside_is_readable(tmp_path):
    secret = tmp_path / "answers.jsonl"
    secret.write_text("EXPECTED-OUTPUT-42")
    program = textwrap.dedent(
        f"""
        import os, glob
        found = []
        for path in [{str(secret)!r}, "/etc/hostname", "/etc/passwd", "/root/.bashrc", """
        f"""{os.getcwd()!r}]:
            try:
                found.append(open(path).read()[:40] if os.path.isfile(path) """
        f"""else str(os.listdir(path)))
            except OSError:
                pass
        found += glob.glob("/*/*answers*") + glob.glob("/*/*/*answers*") + """
        f"""glob.glob("/home/*") + glob.glob("/tmp/*")
        print(found)
    """
    )
    assert run_python(program, "", LIMITS).strip() == "[]"


def test_no_network_not_even_the_trainers_loopback():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    program = textwrap.dedent(f"""
        import socket
        for host in ["127.0.0.1", "1.1.1.1", "::1"]:
            try:
                socket.create_connection((host, {port}), timeout=2)
                print("CONNECTED", host)
            except OSError:
                pass
    """)
    assert "CONNECTED" not in run_python(program, "", LIMITS)
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):
        # nobody called
        listener.accept()
    listener.close()


def _processes_with(marker: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline:
            found.append(cmdline)
    return found


def test_processes_it_starts_do_not_outlive_it():
    program = textwrap.dedent("""
        import os, subprocess
        subprocess.Popen(["sleep", "4242.5"], start_new_session=True)
        if os.fork() == 0:              # a daemon: double fork, own session, parent gone
            os.setsid()
            if os.fork() == 0:
                os.execvp("sleep", ["sleep", "4242.6"])
            os._exit(0)
        print("started")
    """)
    assert run_python(program, "", LIMITS).strip() == "started"
    assert _processes_with("4242.") == []


def _as_trainer(
    attack_template: str, limits: str = "Limits(cpu_s=2, wall_s=20, memory_mb=256)"
) -> subprocess.CompletedProcess:
    """Runs an attack from a sacrificial trainer process; the attack is told the trainer's pid."""
    trainer = textwrap.dedent(f"""
        import os, resource
        from keel.rewards.jail.sandbox import Limits, SandboxViolation, run_python
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        code = {attack_template!r}.replace("TRAINER", str(os.getpid()))
        try:
            run_python(code, "", {limits})
        except SandboxViolation as stopped:
            print("stopped:", stopped)
        grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        print("trainer alive, grew", int(grown_mb), "MB")
    """)
    return subprocess.run(
        [sys.executable, "-c", trainer], capture_output=True, text=True, timeout=600
    )


def test_it_cannot_signal_the_trainer():
    attack = textwrap.dedent("""
        import os, signal
        for target in (TRAINER, os.getppid(), 1, -1):
            for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP):
                try:
                    os.kill(target, sig)
                except OSError:
                    pass
        try:
            os.killpg(TRAINER, signal.SIGKILL)
        except OSError:
            pass
    """)
    trainer = _as_trainer(attack)
    assert trainer.returncode == 0, trainer.stderr
    assert "trainer alive" in trainer.stdout


def test_a_flood_of_output_costs_the_trainer_nothing():
    trainer = _as_trainer(
        "import sys\nwhile True:\n    sys.stdout.write('z' * 65536)",
        "Limits(cpu_s=30, wall_s=60, memory_mb=256, output_bytes=1 << 20)",
    )
    assert trainer.returncode == 0, trainer.stderr
    assert "stopped: output limit" in trainer.stdout
    # MB: the cap, not the flood
    assert int(trainer.stdout.split("grew")[1].split()[0]) < 50


def test_a_fork_bomb_ends_and_leaves_nothing_behind():
    trainer = _as_trainer(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    )
    assert trainer.returncode == 0, trainer.stderr
    assert "trainer alive" in trainer.stdout
    # this machine can still start processes
    assert subprocess.run(["true"]).returncode == 0


def test_it_cannot_become_root_or_remount():
    program = textwrap.dedent(
        """
        import os, subprocess
        for attempt in (lambda: os.setuid(0), lambda: os.chroot("/")):
            try:
                attempt()
                print("ESCALATED")
            except OSError:
                pass
        for cmd in (["mount", "-o", "remount,rw", "/"], """
        """["unshare", "-r", "touch", "/usr/keel_escaped"]):
            try:
                if subprocess.run(cmd, capture_output=True).returncode == 0:
                    print("ESCALATED", cmd)
            except OSError:
                pass
        print(os.getuid())
    """
    )
    out = run_python(program, "", LIMITS)
    assert "ESCALATED" not in out and out.split()[-1] != "0"
    assert not os.path.exists("/usr/keel_escaped")


def test_scratch_space_is_bounded():
    program = (
        "try:\n    open('big', 'wb').write(b'x' * (64 << 20))\nexcept OSError as e:\n    "
        "print(type(e).__name__)"
    )
    assert run_python(
        program, "", Limits(cpu_s=5, wall_s=30, memory_mb=512, scratch_mb=8)
    ).strip() in (
        "OSError",
        "MemoryError",
    )


def test_stopped_programs_are_not_scored_and_the_trainer_carries_on():
    scorer = RewardScorer(by_source={"code": {"code_exec": 1.0}}, max_not_scored_ratio=1.0)
    row = SimpleNamespace(data_source="code", ground_truth=TESTS, extra_info={}, index=0)
    result = scorer.score_batch(
        [row, row],
        ["```python\nwhile True: pass\n```", "a, b = map(int, input().split())\nprint(a + b)"],
    )
    assert result.scored.tolist() == [False, True] and result.scores[1] == 1.0
    assert result.reasons[0].startswith(
        (
            # or, on a loaded machine,
            "raised SandboxViolation: cpu limit",
            "raised SandboxViolation: timeout",
        )
        # the wall clock first
    )
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 0


@pytest.fixture
def no_bubblewrap(monkeypatch):
    """This machine as one without bubblewrap: the probe runs again and finds what holds."""
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
    jail.cache_clear()
    yield jail()
    jail.cache_clear()


def test_without_bubblewrap_the_missing_protections_are_named(no_bubblewrap):
    from keel.check.doctor import check_sandbox

    assert (
        no_bubblewrap.mode.startswith("none")
        and "bubblewrap is not installed" in no_bubblewrap.why_not
    )
    assert {"filesystem", "network", "syscalls"} <= set(no_bubblewrap.missing())
    assert no_bubblewrap.protections["limits"] and no_bubblewrap.protections["output"]
    from keel.check.preflight import sandbox_finding

    doctor = check_sandbox(no_bubblewrap)
    assert doctor.level == "warn" and doctor.code == "KEEL-E010" and "filesystem" in doctor.detail
    # who, and what caps its processes
    assert "runs as " in doctor.detail and "process count" in doctor.detail
    check = sandbox_finding(no_bubblewrap)
    assert (
        check.level == "warn"
        and check.code == "KEEL-E010"
        and "runs without filesystem" in check.message
    )


CODE_ROW = SimpleNamespace(data_source="code", ground_truth=TESTS, extra_info={}, index=0)


def scorer_requiring(require: str) -> RewardScorer:
    return RewardScorer(by_source={"code": {"code_exec": 1.0}}, sandbox_require=require)


def test_model_code_never_runs_unfenced_unless_the_config_says_so(no_bubblewrap, caplog):
    from keel.errors import SANDBOX_INCOMPLETE, KeelError

    # isolation is the default
    for require in ("isolation", "all"):
        with pytest.raises(KeelError) as info:
            scorer_requiring(require).check_records([CODE_ROW])
        assert info.value.code == SANDBOX_INCOMPLETE and "network" in info.value.message
    # at the user's risk, and said so
    scorer_requiring("none").check_records([CODE_ROW])
    assert "runs without: filesystem, network" in caplog.text
    RewardScorer(by_source={"math": {"math_equivalent": 1.0}}, sandbox_require="all").check_records(
        [SimpleNamespace(data_source="math", ground_truth="1", extra_info={}, index=0)]
        # runs no code
    )


def test_a_jail_without_accounting_is_isolation_enough_but_not_all(monkeypatch, caplog):
    from keel.errors import SANDBOX_INCOMPLETE, KeelError
    from keel.rewards.jail import sandbox

    partial = sandbox.Jail(
        jail().mode, {**jail().protections, "accounting": False}, sandbox.NO_CGROUP
    )
    monkeypatch.setattr(sandbox, "jail", lambda: partial)
    scorer_requiring("isolation").check_records([CODE_ROW])
    assert "runs without: accounting" in caplog.text
    with pytest.raises(KeelError) as info:
        scorer_requiring("all").check_records([CODE_ROW])
    assert info.value.code == SANDBOX_INCOMPLETE and "cgroup" in info.value.message


def test_no_namespaces_keyrings_or_memfds_inside():
    """A user namespace would give the program every capability over mounts it makes (a tmpfs
    the size of half the host's memory); the user keyring outlives each run (a channel between
    samples); a memfd's pages are outside RLIMIT_AS."""
    program = textwrap.dedent(
        """
        import ctypes, os, subprocess
        libc = ctypes.CDLL(None, use_errno=True)
        escaped = []
        if libc.unshare(0x10000000) == 0:
            escaped.append("unshare")
        if subprocess.run(["unshare", "-Urm", "true"], capture_output=True).returncode == 0:
            escaped.append("unshare -Urm")
        try:
            os.memfd_create("big")
            escaped.append("memfd")
        except OSError:
            pass
        if libc.syscall(ADD_KEY, b"user", b"keel_probe", b"v", 1, -4) != -1:  """
        """# into the user keyring, @u
            escaped.append("add_key")
        import threading
        threading.Thread(target=print, args=("threads still work",)).start()
        print(escaped)
    """
    )
    import pyseccomp

    program = program.replace(
        "ADD_KEY", str(pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, "add_key"))
    )
    assert run_python(program, "", LIMITS).split("\n")[:2] == ["threads still work", "[]"]


def test_memory_is_bounded_for_the_whole_tree_not_per_process():
    """Four children of 200 MB each under a 256 MB limit: rlimits alone would allow all four."""
    program = textwrap.dedent("""
        import os, time
        for _ in range(4):
            if os.fork() == 0:
                block = b"x" * (200 << 20)
                time.sleep(30)
                os._exit(0)
        for _ in range(4):
            os.wait()
    """)
    with pytest.raises(SandboxViolation) as info:
        run_python(program, "", Limits(cpu_s=20, wall_s=60, memory_mb=256))
    assert "memory limit" in str(info.value)


def test_cpu_is_bounded_for_the_whole_tree_not_per_process():
    """Each process spins just under the limit, forks and exits: RLIMIT_CPU starts again in every
    child, the tree's CPU time does not."""
    program = textwrap.dedent("""
        import os, sys, time
        for lane in range(2):
            if os.fork() == 0:
                break
        else:
            time.sleep(20)
            print("main done")
            sys.exit(0)
        while True:
            start = time.process_time()
            while time.process_time() - start < 0.8:
                pass
            if os.fork() != 0:
                os._exit(0)
    """)
    with pytest.raises(SandboxViolation) as info:
        run_python(program, "", Limits(cpu_s=2, wall_s=120, memory_mb=256))
    assert "cpu limit" in str(info.value)


@pytest.mark.parametrize(
    "fake",
    [
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
        "raise SystemExit(152)",
        "import sys\nsys.stderr.write('MemoryError')\nsys.exit(1)",
    ],
)
def test_a_program_cannot_fake_a_limit_to_dodge_a_wrong_answer(fake):
    """Not scored would take a wrong answer out of the update: the verdict comes from the kernel's
    books for the run (its cgroup), not from how the program ended."""
    # an ordinary failure: the test case is failed
    assert run_python(fake, "", LIMITS) == ""


def _processes_of_uid(uid: int) -> int:
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = open(f"/proc/{pid}/status").read()
        except OSError:
            continue
        count += f"\nUid:\t{uid}\t" in status
    return count


def test_one_run_cannot_starve_another_of_processes():
    """Concurrent runs share uid 65534: a per-user process limit would let one sample fill it and
    fail a correct program running beside it."""
    import threading
    import time

    outcome = []

    def attack() -> None:
        try:
            run_python(
                "import os, time\nfor _ in range(40):\n    try:\n        os.fork() or "
                "time.sleep(30)\n    except OSError:\n        break\ntime.sleep(30)",
                "",
                Limits(cpu_s=5, wall_s=20, memory_mb=256),
            )
        except SandboxViolation as stopped:
            outcome.append(str(stopped))

    attacker = threading.Thread(target=attack)
    attacker.start()
    # until the attacker holds its share of processes (polled, not timed)
    for _ in range(600):
        if _processes_of_uid(65534) >= 20:
            break
        time.sleep(0.1)
    assert _processes_of_uid(65534) >= 20
    victim = (
        "import threading\nthreading.Thread(target=print, args=(sum(map(int, "
        "input().split())),)).start()"
    )
    assert run_python(victim, "2 3\n", LIMITS).strip() == "5"
    attacker.join()
    assert outcome and outcome[0].startswith("timeout")


SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(
    os.getuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
    reason="needs root to become another user, and a system Python that user can run",
)
def test_a_trainer_that_is_not_root_gets_a_user_namespace_jail():
    """Most users are not root: bubblewrap then runs unprivileged in a user namespace. Run as
    uid 65534 with the system Python (keel from this tree, without pyseccomp), as such a user."""
    import tempfile
    from pathlib import Path

    # readable by that user
    with tempfile.NamedTemporaryFile("w", dir="/tmp", suffix=".jsonl") as secret:
        secret.write("the trainer's data")
        secret.flush()
        os.chmod(secret.name, 0o644)
        probe = f"import os; print(os.path.exists({secret.name!r}))"
        script = textwrap.dedent(f"""
            import sys
            sys.modules["pyseccomp"] = None
            from keel.rewards.jail.sandbox import jail, run_python
            found = jail()
            print(found.mode, sorted(found.missing()))
            exec({probe!r})
            print(run_python({probe!r}).strip())
        """)
        done = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "env",
                "-i",
                "PATH=/usr/bin:/bin",
                f"PYTHONPATH={Path(__file__).parents[2]}",
                SYSTEM_PYTHON,
                "-c",
                script,
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd="/tmp",
        )
    assert done.returncode == 0, done.stderr
    mode_line, outside, inside = done.stdout.split("\n")[:3]
    assert mode_line == "bubblewrap in a user namespace ['accounting', 'syscalls']"
    # the trainer's user sees the file; its jail does not
    assert (outside, inside) == ("True", "False")


def test_doctor_names_the_user_and_the_process_cap_and_what_is_missing():
    from keel.check.doctor import check_sandbox_processes, check_sandbox_user
    from keel.rewards.jail import sandbox

    found = jail()
    assert (
        check_sandbox_user(found).level == "pass"
        and "uid 65534 without capabilities" in check_sandbox_user(found).detail
    )
    assert (
        check_sandbox_processes(found).level == "pass"
        and found.process_cap in check_sandbox_processes(found).detail
    )
    as_root = sandbox.Jail(
        "none", {**found.protections, "user": False, "process count": False}, "", ""
    )
    user, processes = check_sandbox_user(as_root), check_sandbox_processes(as_root)
    assert (user.level, user.code, processes.level, processes.code) == (
        "warn",
        "KEEL-E010",
        "warn",
        "KEEL-E010",
    )
    assert (
        "raise its own limits" in user.detail and "not capped" in processes.detail and processes.fix
    )


def test_an_uncapped_process_count_is_not_isolation(monkeypatch):
    """A fork bomb fills the machine's process table: the default reward.sandbox.require refuses a
    jail that cannot cap it, and says so."""
    from keel.errors import SANDBOX_INCOMPLETE, KeelError
    from keel.rewards.jail import sandbox

    uncapped = sandbox.Jail(
        jail().mode, {**jail().protections, "process count": False}, sandbox.NO_PROCESS_CAP
    )
    monkeypatch.setattr(sandbox, "jail", lambda: uncapped)
    with pytest.raises(KeelError) as info:
        scorer_requiring("isolation").check_records([CODE_ROW])
    assert info.value.code == SANDBOX_INCOMPLETE and "process count" in info.value.message
    scorer_requiring("none").check_records([CODE_ROW])
