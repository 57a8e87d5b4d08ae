"""User hooks: `trainer.hooks: ["package.module:function"]`, called every `trainer.hook_freq` steps
as `function(step, metrics, batch)`. A hook may add entries to `metrics` (they are logged) and
return warnings (strings) to print; keel's own guards are hooks of the same shape."""

from __future__ import annotations

import importlib
from typing import Callable

from keel.errors import HOOK_LOAD, KeelError

Hook = Callable[[int, dict, object], "list[str] | None"]


def load_hook(spec: str) -> Hook:
    module_name, sep, function_name = spec.partition(":")
    if not sep or not module_name or not function_name:
        raise KeelError(HOOK_LOAD, f"trainer.hooks entry {spec!r} is not module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module: whatever it raises on import is theirs to fix
        raise KeelError(HOOK_LOAD, f"importing {module_name!r} for hook {spec!r} failed: {type(e).__name__}: {e}") from e
    hook = getattr(module, function_name, None)
    if not callable(hook):
        raise KeelError(HOOK_LOAD, f"{module_name!r} has no function {function_name!r}")
    return hook


def run_hooks(hooks: list[Hook], step: int, metrics: dict, batch) -> list[str]:
    warnings: list[str] = []
    for hook in hooks:
        warnings += hook(step, metrics, batch) or []
    return warnings
