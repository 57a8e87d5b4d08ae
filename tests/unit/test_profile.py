"""keel bench --profile's GPU-busy share per phase, from profiler events (synthetic here: the
CPU machine has no device events; the GPU session runs the real thing)."""

from types import SimpleNamespace

from torch.autograd import DeviceType

from keel.observe.profile import (
    covered_time,
    idle_gaps,
    phase_busy,
    phase_gpu_seconds,
    phase_kernels,
)


def event(name, start, end, device=DeviceType.CUDA, annotation=False, thread=1):
    return SimpleNamespace(
        name=name,
        device_type=device,
        is_user_annotation=annotation,
        thread=thread,
        time_range=SimpleNamespace(start=start, end=end),
    )


def phase(name, start, end):
    return event(name, start, end, DeviceType.CPU, annotation=True)


def test_overlapping_activity_counts_once_and_only_inside_the_range():
    assert covered_time([(0, 2), (1, 3), (5, 6), (7, 20)], 1, 10) == 2 + 1 + 3
    assert covered_time([(0, 1)], 2, 4) == 0.0
    # an interval inside another adds nothing
    assert covered_time([(0, 10), (2, 3)], 1, 4) == 3


def test_each_phase_gets_the_share_of_its_wall_time_the_device_was_busy():
    events = [
        phase("gen", 0, 100),
        phase("update_actor", 100, 200),
        phase("gen", 200, 300),
        event("kernel", 10, 60),
        # gen: 80 of 100
        event("kernel", 50, 90),
        event("memcpy", 100, 110),
        # update: 10 + 50 of 100
        event("kernel", 150, 250),
        # second gen: 10 + 50 spill-over
        event("kernel", 290, 300),
        # the device's own span: not activity
        event("gpu annotation", 0, 300, annotation=True),
        event("aten::mm", 0, 300, DeviceType.CPU),
        # a CPU op: not a phase, not activity
    ]
    busy = phase_busy(events)
    assert busy == {"gen": (80 + 60) / 200, "update_actor": 0.6}
    # the profiler's microseconds
    assert phase_gpu_seconds(events) == {"gen": 140e-6, "update_actor": 60e-6}


def test_the_longest_idle_gaps_name_what_the_host_was_doing():
    events = [
        phase("worker/update_actor", 0, 10_000),
        phase("reward", 10_000, 20_000),
        event("fwd", 0, 3_000),
        # busy until 3.5 ms
        event("copy", 2_000, 3_500),
        # 1.5 ms idle before it
        event("bwd", 5_000, 9_000),
        # the host waited, then...
        event("aten::item", 3_400, 4_000, DeviceType.CPU),
        # ... indexed on the CPU
        event("aten::index", 4_200, 4_900, DeviceType.CPU),
        # (the outer op of the index)
        event("aten::_to_copy", 4_100, 4_950, DeviceType.CPU),
        # another thread's
        event("autograd::engine", 4_300, 4_800, DeviceType.CPU, thread=2),
        # 0.05 ms: below the floor
        event("opt", 9_000, 9_950),
        event("kernel", 12_000, 13_000),
        # in "reward": not asked for
    ]
    assert idle_gaps(events) == [
        {
            "phase": "worker/update_actor",
            "at_ms": 3.5,
            "ms": 1.5,
            "after": "copy",
            "before": "bwd",
            "host": "aten::index",
        }
    ]
    tail = idle_gaps(events, phases=("worker/update_actor", "reward"), min_length=40)
    assert {
        "phase": "reward",
        "at_ms": 0.0,
        "ms": 2.0,
        "after": "(phase start)",
        "before": "kernel",
        "host": "python",
    } in tail
    assert {
        "phase": "worker/update_actor",
        "at_ms": 9.95,
        "ms": 0.05,
        "after": "opt",
        "before": "(phase end)",
        "host": "python",
    } in tail
    assert [g["ms"] for g in tail] == sorted((g["ms"] for g in tail), reverse=True)


def test_each_phase_lists_its_own_costliest_kernels_with_launches_summed():
    events = [
        phase("worker/compute_log_probs", 0, 1_000),
        phase("worker/update_actor", 1_000, 5_000),
        # the pass's GEMM: not the update's
        event("gemm", 0, 900),
        event("gemm", 1_000, 1_500),
        event("gemm", 2_000, 2_500),
        event("silu", 1_500, 1_800),
        event("adamw", 4_000, 4_100),
        # the device's own span, and a host op: neither is a kernel
        event("gpu annotation", 1_000, 5_000, annotation=True),
        event("aten::mm", 1_000, 5_000, DeviceType.CPU),
    ]
    assert phase_kernels(events) == [
        {"phase": "worker/compute_log_probs", "ms": 0.9, "n": 1, "kernel": "gemm"},
        {"phase": "worker/update_actor", "ms": 1.0, "n": 2, "kernel": "gemm"},
        {"phase": "worker/update_actor", "ms": 0.3, "n": 1, "kernel": "silu"},
        {"phase": "worker/update_actor", "ms": 0.1, "n": 1, "kernel": "adamw"},
    ]
    assert [row["kernel"] for row in phase_kernels(events, top=1)] == ["gemm", "gemm"]
