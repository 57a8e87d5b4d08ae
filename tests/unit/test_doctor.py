"""keel doctor: each check against the facts of a healthy and of a broken machine."""

import json

from keel.check.doctor import (
    check_cuda,
    check_disk,
    check_gpu_arch,
    check_package,
    check_python,
    check_torch,
)
from keel.cli import main
from keel.errors import (
    CUDA_DRIVER_TOO_OLD,
    GPU_ARCH_UNSUPPORTED,
    LOW_DISK,
    PACKAGE_VERSION,
    TORCH_UNSUPPORTED,
)


def test_torch_with_the_fsdp_gradient_bug_is_rejected():
    assert check_torch("2.3.1+cu121").code == TORCH_UNSUPPORTED
    assert check_torch("2.1.0").code == TORCH_UNSUPPORTED
    assert check_torch("2.11.0+cu130").level == "pass"


def test_the_torch_keel_needs_is_the_one_pyproject_requires(capsys):
    """One number: keel doctor, KEEL-E004's text and pyproject.toml's requirement."""
    import re
    from pathlib import Path

    from keel.check.doctor import SUPPORTED
    from keel.errors import CATALOGUE, MIN_TORCH

    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert re.search(r'"torch>=([\d.]+)"', pyproject).group(1) == MIN_TORCH
    for name, (low, _) in SUPPORTED.items():
        assert f'"{name}>={low}"' in pyproject, name
    older = f"2.{int(MIN_TORCH.split('.')[1]) - 1}.0"
    assert (
        check_torch(older).code == TORCH_UNSUPPORTED
        and check_torch(MIN_TORCH + ".0").level == "pass"
    )
    assert (
        f">= {MIN_TORCH}" in check_torch(older).detail
        and f"torch>={MIN_TORCH}" in check_torch(older).fix
    )
    assert f"torch >= {MIN_TORCH}" in CATALOGUE[TORCH_UNSUPPORTED].cause
    assert f"torch>={MIN_TORCH}" in CATALOGUE[TORCH_UNSUPPORTED].fix


def test_package_ranges():
    assert check_package("transformers", "4.40.0").code == PACKAGE_VERSION
    assert check_package("transformers", None).code == PACKAGE_VERSION
    # only LoRA needs it
    assert check_package("peft", None).level == "warn"
    assert check_package("transformers", "5.17.0").level == "pass"
    assert check_python((3, 9)).code == PACKAGE_VERSION


def test_driver_older_than_torch_cuda():
    # torch for CUDA 13.0 with a driver that supports up to CUDA 12.4 (cuDriverGetVersion 12040)
    assert check_cuda("13.0", 12040, ["NVIDIA H200"]).code == CUDA_DRIVER_TOO_OLD
    assert check_cuda("12.8", 13000, ["NVIDIA H200"]).level == "pass"
    # CPU build: runs, slowly
    assert check_cuda(None, None, []).level == "warn"


def test_gpu_without_kernels_in_this_build():
    assert check_gpu_arch([(12, 0)], ["sm_80", "sm_90"]).code == GPU_ARCH_UNSUPPORTED
    assert check_gpu_arch([(9, 0)], ["sm_80", "sm_90"]).level == "pass"


def test_low_disk_warns():
    assert check_disk("/x", 3.0).code == LOW_DISK
    assert check_disk("/x", 300.0).level == "pass"


def test_doctor_runs_here(capsys):
    code = main(["doctor", "--json"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert {"python", "torch", "transformers", "cuda", "gpu arch", "disk"} <= set(checks)
    assert code == (1 if any(c["level"] == "fail" for c in checks.values()) else 0)
    assert checks["torch"]["level"] == "pass"
