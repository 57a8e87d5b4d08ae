"""verl's own modules, imported without verl's heavy dependencies, for tests that compare keel with
verl.

verl installs with `pip install --no-deps` (make install does). Its package `__init__` files pull in
Ray, torch and tensordict; the modules the tests run (reward scorers, tool and interaction base
classes) need none of them. This shim registers verl's packages by path without running their
`__init__`, and stands in for the two light helpers those modules import from heavy ones
(`verl.utils.ray_utils.get_event_loop`, `verl.utils.metric.Metric`)."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest

VERL_VERSION = "0.9.1"


def verl_root() -> Path | None:
    if getattr(sys.modules.get("verl"), "__keel_shim__", False):
        return Path(sys.modules["verl"].__path__[0])
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _package(name: str, path: Path) -> None:
    if name in sys.modules and getattr(sys.modules[name], "__keel_shim__", False):
        return
    module = types.ModuleType(name)
    module.__path__ = [str(path)]
    module.__spec__ = importlib.util.spec_from_loader(name, None, is_package=True)
    module.__spec__.submodule_search_locations = [str(path)]
    module.__keel_shim__ = True
    sys.modules[name] = module


def _stub(name: str, **attributes) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module


def _event_loop():
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.new_event_loop()


def install() -> Path:
    """Registers verl's packages (skipping their __init__ files); returns verl's directory. Skips
    the calling test when verl is not installed."""
    root = verl_root()
    if root is None:
        pytest.skip("verl is not installed (make install: pip install --no-deps verl)")
    _package("verl", root)
    for package in ("utils", "tools", "tools.utils", "interactions", "workers", "experimental"):
        if (root / package.replace(".", "/")).is_dir():
            _package(f"verl.{package}", root / package.replace(".", "/"))
    _stub("verl.utils.ray_utils", get_event_loop=_event_loop)
    _stub("verl.utils.metric", Metric=object, AggregationType=object, reduce_metrics=lambda m: m)
    return root


def verl_module(name: str):
    """verl's module `name` (e.g. "verl.utils.reward_score.math_dapo"), imported through the
    shim."""
    install()
    return importlib.import_module(name)


VERL_0_5_0_FILES = Path(__file__).parent / "data" / "verl_0_5_0"


def install_verl_0_5_0_files() -> Path:
    """verl 0.5.0's gsm8k tool and interactions (tests/data/verl_0_5_0, files 0.9.1 no longer ships)
    importable as `verl.tools.gsm8k_tool` and `verl.interactions.*`, beside the installed verl's own
    modules: the tool's `from .base_tool import BaseTool` is 0.9.1's."""
    root = install()
    for package in ("tools", "interactions"):
        if f"verl.{package}" not in sys.modules:
            _package(f"verl.{package}", VERL_0_5_0_FILES / package)
        path = sys.modules[f"verl.{package}"].__path__
        if str(VERL_0_5_0_FILES / package) not in path:
            path.append(str(VERL_0_5_0_FILES / package))
    return root
