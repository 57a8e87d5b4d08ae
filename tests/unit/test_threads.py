"""torch's CPU threads follow the cores other processes leave free (keel/training/threads.py)."""

import os
import subprocess
import sys
import time

import pytest
import torch

from keel.errors import BAD_VALUE, KeelError
from keel.training import threads
from keel.training.threads import CpuThreads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_are_the_cores_others_leave_free(monkeypatch, restore_threads):
    """Others used 1.5 of 4 cores over the last step (busy 9 CPU-s in 2 s, 6 of them this process's):
    2.5 cores are free, so 2 threads (round to nearest, at least one, at most the cores)."""
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    readings = iter([(0.0, 100.0, 50.0), (2.0, 109.0, 56.0), (3.0, 109.0, 56.0), (4.0, 113.0, 56.0)])
    monkeypatch.setattr(CpuThreads, "_reading", lambda self: next(readings))
    cpu = CpuThreads("auto")

    assert cpu.adjust() == 2          # 4 - (9 - 6) / 2
    assert cpu.adjust() == 4          # nobody else used the cores
    assert cpu.adjust() == 1          # others used all 4: one thread, never none
    cpu.close()


def test_a_number_or_fixed_is_kept_and_the_process_gets_its_threads_back(restore_threads):
    torch.set_num_threads(2)
    one = CpuThreads("1")
    assert one.adjust() == 1
    one.close()
    assert torch.get_num_threads() == 2
    assert CpuThreads("fixed").adjust() == 2


def test_omp_num_threads_is_the_users_choice(monkeypatch):
    monkeypatch.delenv("KEEL_CPU_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert CpuThreads().policy == "fixed"


@pytest.mark.parametrize("value", ["two", "0", "-1", "1.5"])
def test_a_bad_keel_cpu_threads_is_an_error_naming_it(value, monkeypatch):
    monkeypatch.setenv("KEEL_CPU_THREADS", value)
    with pytest.raises(KeelError) as e:
        CpuThreads()
    assert e.value.code == BAD_VALUE and "KEEL_CPU_THREADS" in e.value.message and "auto" in e.value.fix


@pytest.mark.skipif(not os.path.exists("/proc/stat") or len(os.sched_getaffinity(0)) < 2, reason="needs /proc, 2 cores")
def test_busy_neighbours_take_threads_away(restore_threads):
    """Two processes spinning on this process's cores: a run beside them gets fewer threads than cores."""
    cores = os.sched_getaffinity(0)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(1.0)  # started and spinning
        cpu = CpuThreads("auto")
        time.sleep(0.5)  # a "step" in which this process waits
        assert cpu.adjust() <= len(cores) - 1
    finally:
        for p in spinners:
            p.kill()
            p.wait()
