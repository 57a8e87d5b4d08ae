"""keel bench --profile's GPU-busy share per phase, from profiler events (synthetic here: the
CPU machine has no device events; the GPU session runs the real thing)."""

from types import SimpleNamespace

from torch.autograd import DeviceType

from keel.observe.profile import covered_time, phase_busy


def event(name, start, end, device=DeviceType.CUDA, annotation=False):
    return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                           time_range=SimpleNamespace(start=start, end=end))


def phase(name, start, end):
    return event(name, start, end, DeviceType.CPU, annotation=True)


def test_overlapping_activity_counts_once_and_only_inside_the_range():
    assert covered_time([(0, 2), (1, 3), (5, 6), (7, 20)], 1, 10) == 2 + 1 + 3
    assert covered_time([(0, 1)], 2, 4) == 0.0
    assert covered_time([(0, 10), (2, 3)], 1, 4) == 3  # an interval inside another adds nothing


def test_each_phase_gets_the_share_of_its_wall_time_the_device_was_busy():
    events = [phase("gen", 0, 100), phase("update_actor", 100, 200), phase("gen", 200, 300),
              event("kernel", 10, 60), event("kernel", 50, 90),      # gen: 80 of 100
              event("memcpy", 100, 110), event("kernel", 150, 250),  # update: 10 + 50 of 100
              event("kernel", 290, 300),                             # second gen: 10 + 50 spill-over
              event("gpu annotation", 0, 300, annotation=True),      # the device's own span: not activity
              event("aten::mm", 0, 300, DeviceType.CPU)]             # a CPU op: not a phase, not activity
    busy = phase_busy(events)
    assert busy == {"gen": (80 + 60) / 200, "update_actor": 0.6}
