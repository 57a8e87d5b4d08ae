"""Hopper's programmatic dependent launch for the decode step (runner.PROGRAMMATIC_LAUNCH): keel's
kernels wait for the kernel before them ahead of their first read, inductor is asked for the same,
and nothing changes where it is off or cannot run. Its speed and bits are the GPU's to show
(tests/gpu/test_native_cuda.py, benchmarks/levers.py pdl)."""

import pytest
import torch

from keel.models.tiny import build_model_config
from keel.rollout.native import layers, runner
from keel.rollout.native.models import family_for

from tests_helpers import compile_for_hopper


def _attention_ptx(pdl: bool) -> str:
    from keel.rollout.native.attention_kernels import decode_attention_kernel

    pointers = dict.fromkeys(["Q", "K", "V", "KCache", "VCache", "Out", "Sinks"], "*bf16")
    pointers |= dict.fromkeys(["Cos", "Sin", "QNorm", "KNorm"], "*bf16")
    pointers |= dict.fromkeys(["PartialOut", "PartialLse"], "*fp32")
    pointers |= dict.fromkeys(["Pad", "Column", "Rows", "PrefixRow", "PrefixLen"], "*i64")
    constants = dict(GROUP=2, BLOCK_GROUP=16, DIM=128, BLOCK=64, ONE_PASS=True, INDIRECT=True)
    constants |= dict(COLUMN_STRIDE=1, SINKS=False, SHARED=True, ROTARY=True, QK_NORM=True)
    constants |= dict(PDL=pdl)
    return compile_for_hopper(decode_attention_kernel, pointers, constants, ("scale", "eps"))


def _record_ptx(pdl: bool) -> str:
    from keel.rollout.native.record_kernel import record_kernel

    pointers = {name: "*i64" for name in record_kernel.arg_names if name[0].isupper()}
    pointers |= dict.fromkeys(["LogProb", "LogProbs"], "*fp32") | dict.fromkeys(
        ["Done", "Live"], "*i1"
    )
    constants = dict(IGNORE_EOS=False, BLOCK_EOS=2, LENGTH=True, PDL=pdl)
    pointers = {name: kind for name, kind in pointers.items() if name not in constants}
    return compile_for_hopper(record_kernel, pointers, constants)


@pytest.mark.parametrize("ptx_of", [_attention_ptx, _record_ptx])
def test_keels_decode_kernels_wait_for_the_kernel_before_their_first_read(ptx_of):
    """Compiled for sm_90 where Triton is installed: launched programmatically, a kernel's first
    global load comes after griddepcontrol.wait (it may start before the kernel it follows has
    written), and it lets the next kernel start; launched plainly it has neither instruction."""
    pytest.importorskip("triton")
    ptx = ptx_of(True)
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    assert "griddepcontrol" not in ptx_of(False)


def test_programmatic_launch_needs_the_switch_and_a_hopper_gpu(monkeypatch):
    monkeypatch.setattr(runner, "PROGRAMMATIC_LAUNCH", True)
    assert not runner.programmatic_launch(torch.device("cpu"))
    monkeypatch.setattr(runner, "PROGRAMMATIC_LAUNCH", False)
    assert not runner.programmatic_launch(torch.device("cpu"))


def _compile_calls(monkeypatch, **step_options) -> list[dict]:
    calls = []

    def compile(fn, **kwargs):
        calls.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", compile)
    family = family_for(build_model_config("qwen2"))
    layers.StepFunctions(family, compiled=True, **step_options)
    return calls


def test_the_step_functions_ask_inductor_for_it_only_when_programmatic(monkeypatch):
    plain = _compile_calls(monkeypatch)
    assert plain and all(call["options"] is None for call in plain)
    programmatic = _compile_calls(monkeypatch, programmatic=True, exact=True)
    assert all(
        call["options"] == {"emulate_precision_casts": True, "triton.enable_pdl": True}
        for call in programmatic
    )


def test_a_compile_mode_joins_the_options_as_its_own(monkeypatch):
    """torch.compile takes a mode or options, not both: with both, the mode's options."""
    calls = _compile_calls(monkeypatch, mode="max-autotune-no-cudagraphs", programmatic=True)
    assert all(
        call["mode"] is None
        and call["options"]["max_autotune"]
        and call["options"]["triton.enable_pdl"]
        for call in calls
    )
    assert all(
        call["mode"] == "max-autotune-no-cudagraphs"
        for call in _compile_calls(monkeypatch, mode="max-autotune-no-cudagraphs")
    )
