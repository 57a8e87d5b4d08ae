"""`keel doctor`: is this machine fit to run keel? Versions, GPU, driver, disk.

Each check is a function of the facts it reads (versions, capability, sizes), so tests can hand it
the facts of a broken machine; `collect()` reads this machine's.
"""

from __future__ import annotations

import ctypes
import platform
import shutil
import sys
from dataclasses import asdict, dataclass
from importlib import metadata

from packaging.version import Version

from keel.check.findings import FAIL, PASS, WARN
from keel.errors import (
    CUDA_DRIVER_TOO_OLD,
    GPU_ARCH_UNSUPPORTED,
    LOW_DISK,
    MIN_TORCH,
    PACKAGE_VERSION,
    SANDBOX_INCOMPLETE,
    TORCH_UNSUPPORTED,
)
from keel.openmp import how_threads_wait
from keel.rewards.jail.sandbox import jail

# (minimum, maximum exclusive or None) of what keel is tested with
SUPPORTED = {"transformers": ("4.53", None), "peft": ("0.13", None), "tokenizers": ("0.20", None)}
MIN_FREE_DISK_GB = 10


@dataclass
class Check:
    name: str
    level: str
    detail: str
    code: str | None = None
    # what to run, for a failure
    fix: str | None = None


def check_python(version: tuple[int, int]) -> Check:
    ok = version >= (3, 10)
    return Check(
        "python",
        PASS if ok else FAIL,
        f"{version[0]}.{version[1]}",
        None if ok else PACKAGE_VERSION,
    )


def check_torch(version: str) -> Check:
    v = Version(version.split("+")[0])
    if v < Version(MIN_TORCH):
        # FSDP2's fully_shard; torch 2.3's FSDP could also leave gradients None: the loss moves,
        # nothing learns
        bug = "; 2.3.x has the FSDP gradient bug" if (v.major, v.minor) == (2, 3) else ""
        return Check(
            "torch",
            FAIL,
            f"{version}: keel needs >= {MIN_TORCH}{bug}",
            TORCH_UNSUPPORTED,
            f"`pip install 'torch>={MIN_TORCH}'` (a build for the CUDA the driver supports)",
        )
    return Check("torch", PASS, version)


def check_package(name: str, version: str | None) -> Check:
    low, high = SUPPORTED[name]
    install = f"`pip install '{name}>={low}" + (f",<{high}" if high else "") + "'`"
    if version is None:
        level = WARN if name == "peft" else FAIL
        return Check(
            name,
            level,
            "not installed" + (" (needed for LoRA only)" if name == "peft" else ""),
            None if level == WARN else PACKAGE_VERSION,
            install,
        )
    v = Version(version)
    if v < Version(low) or (high and v >= Version(high)):
        return Check(
            name,
            FAIL,
            f"{version}: keel supports >= {low}" + (f", < {high}" if high else ""),
            PACKAGE_VERSION,
            install,
        )
    return Check(name, PASS, version)


def check_cuda(torch_cuda: str | None, driver: int | None, gpus: list[str]) -> Check:
    """`driver` is cuDriverGetVersion's number (12040 = CUDA 12.4): the newest CUDA it supports."""
    if torch_cuda is None:
        return Check(
            "cuda", WARN, "torch is a CPU build: keel runs on CPU only (slow for real models)"
        )
    if driver is None:
        return Check(
            "cuda", WARN, f"torch built for CUDA {torch_cuda}, but no NVIDIA driver found: CPU only"
        )
    driver_version = (driver // 1000, driver % 1000 // 10)
    needed = tuple(int(x) for x in torch_cuda.split(".")[:2])
    # minor versions are compatible within a major release
    if driver_version[0] < needed[0]:
        return Check(
            "cuda",
            FAIL,
            f"torch is built for CUDA {torch_cuda} but the driver supports up to "
            f"{driver_version[0]}.{driver_version[1]}: update the driver or install a "
            "torch build for an older CUDA",
            CUDA_DRIVER_TOO_OLD,
        )
    if not gpus:
        return Check("cuda", WARN, "driver present but no GPU visible (CUDA_VISIBLE_DEVICES?)")
    return Check(
        "cuda",
        PASS,
        f"CUDA {torch_cuda}, driver supports {driver_version[0]}.{driver_version[1]}; "
        f"{len(gpus)} GPU(s): {', '.join(sorted(set(gpus)))}",
    )


def check_gpu_arch(capabilities: list[tuple[int, int]], arch_list: list[str]) -> Check:
    """Each GPU's compute capability must have kernels (sm_XY) in this torch build."""
    if not capabilities:
        return Check("gpu arch", WARN, "no GPU to check")
    missing = sorted({f"sm_{a}{b}" for a, b in capabilities} - set(arch_list))
    if missing:
        return Check(
            "gpu arch",
            FAIL,
            f"this torch build has no kernels for {missing} (it has {arch_list})",
            GPU_ARCH_UNSUPPORTED,
        )
    return Check("gpu arch", PASS, ", ".join(f"sm_{a}{b}" for a, b in sorted(set(capabilities))))


def check_distributed(nccl: bool, ray: str | None) -> Check:
    parts = [
        f"NCCL {'available' if nccl else 'not available'}",
        f"Ray {ray}" if ray else "Ray not installed (needed for multi-node runs)",
    ]
    return Check("distributed", PASS if nccl and ray else WARN, "; ".join(parts))


def check_sandbox(found) -> Check:
    """The jail model-written code runs in: every protection, or the ones missing and why."""
    return Check(
        "sandbox",
        PASS if found.complete else WARN,
        found.summary(),
        None if found.complete else SANDBOX_INCOMPLETE,
    )


def check_sandbox_user(found) -> Check:
    """Who model-written code runs as: an unprivileged user without capabilities, or what it
    holds."""
    if found.protections["user"]:
        return Check("sandbox user", PASS, found.runs_as())
    return Check(
        "sandbox user",
        WARN,
        f"model-written code runs as {found.runs_as()}: it could raise its own limits",
        SANDBOX_INCOMPLETE,
        "install bubblewrap (`apt-get install bubblewrap`) and setpriv "
        "(util-linux), or make the interpreter readable by uid 65534 so root can drop to it",
    )


def check_sandbox_processes(found) -> Check:
    """What caps the process count of model-written code (a fork bomb), or that nothing does."""
    if found.protections["process count"]:
        return Check("sandbox pids", PASS, found.caps_processes())
    return Check(
        "sandbox pids",
        WARN,
        f"{found.caps_processes()}: a fork bomb runs until the wall-clock limit",
        SANDBOX_INCOMPLETE,
        "give keel a cgroup it can write (cgroup v1 pids, or a v2 subtree with memory "
        "and pids delegated), or allow user namespaces (sysctl user.max_user_namespaces > 0)",
    )


def check_cpu_threads(as_meant: bool, how: str) -> Check:
    """How torch's OpenMP threads wait (keel/openmp.py): spinning slows a CPU run beside busy
    processes."""
    return Check("cpu threads", PASS if as_meant else WARN, how)


def check_disk(path: str, free_gb: float) -> Check:
    if free_gb < MIN_FREE_DISK_GB:
        return Check(
            "disk",
            WARN,
            f"{free_gb:.1f} GB free at {path}: checkpoints of a 7B model take ~28 GB each",
            LOW_DISK,
        )
    return Check("disk", PASS, f"{free_gb:.0f} GB free at {path}")


# --- this machine's facts -------------------------------------------------------------------


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cuda_driver_version() -> int | None:
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int()
    return version.value if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0 else None


def collect(path: str = ".") -> list[Check]:
    import torch

    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else []
    )
    capabilities = [torch.cuda.get_device_capability(i) for i in range(len(gpus))]
    return [
        check_python(sys.version_info[:2]),
        check_torch(torch.__version__),
        *(check_package(name, installed(name)) for name in SUPPORTED),
        Check("keel", PASS, installed("keel") or "source tree (not installed)"),
        check_cuda(torch.version.cuda, cuda_driver_version(), gpus),
        check_gpu_arch(capabilities, torch.cuda.get_arch_list() if gpus else []),
        check_distributed(
            torch.distributed.is_available() and torch.distributed.is_nccl_available(),
            installed("ray"),
        ),
        check_sandbox(jail()),
        check_sandbox_user(jail()),
        check_sandbox_processes(jail()),
        check_cpu_threads(*how_threads_wait()),
        check_disk(path, shutil.disk_usage(path).free / 2**30),
    ]


def render(checks: list[Check]) -> str:
    marks = {PASS: "ok  ", WARN: "warn", FAIL: "FAIL"}
    lines = [f"keel doctor ({platform.node()}, {platform.platform()})"]
    for c in checks:
        lines.append(
            f"  [{marks[c.level]}] {c.name:<12} {c.detail}" + (f"  ({c.code})" if c.code else "")
        )
        lines += [f"         fix: {c.fix}"] if c.fix and c.level != PASS else []
    fails = sum(c.level == FAIL for c in checks)
    warns = sum(c.level == WARN for c in checks)
    lines.append(f"{len(checks) - fails - warns} passed, {warns} warnings, {fails} failed")
    return "\n".join(lines)


def as_json(checks: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks]
