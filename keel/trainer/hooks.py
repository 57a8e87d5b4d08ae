"""User hooks: `trainer.hooks: ["package.module:function"]`, called every `trainer.hook_freq` steps
as `function(step, metrics, batch)`. A hook may add entries to `metrics` (they are logged) and
return warnings (strings) to print; keel's own guards are hooks of the same shape."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

from keel.errors import HOOK_LOAD, KeelError
from keel.errors.fixes import closest, setting

Hook = Callable[[int, dict, object], "list[str] | None"]


def load_hook(spec: str, hooks: list[str] | None = None) -> Hook:
    """`hooks`: every entry of trainer.hooks, for a fix that replaces this one among them."""
    hooks = hooks or [spec]

    def replaced(entry: str) -> str:
        return setting("trainer.hooks", [entry if h == spec else h for h in hooks])

    module_name, sep, function_name = spec.partition(":")
    if not sep or not module_name or not function_name:
        # `module.function`, the colon written as a dot
        dotted = spec.rpartition(".")
        fix = f"set {replaced(f'{dotted[0]}:{dotted[2]}')}" if dotted[0] and not sep else None
        raise KeelError(HOOK_LOAD, f"trainer.hooks entry {spec!r} is not module:function", fix)
    try:
        module = importlib.import_module(module_name)
    # the user's module: whatever it raises on import is theirs to fix
    except Exception as e:
        found = Path(module_name.replace(".", "/") + ".py")
        fix = (
            f"run with `export PYTHONPATH={Path.cwd()}` ({found} is here, and the keel command "
            "does not import from the working directory)"
            if isinstance(e, ModuleNotFoundError) and found.is_file()
            else None
        )
        raise KeelError(
            HOOK_LOAD,
            f"importing {module_name!r} for hook {spec!r} failed: {type(e).__name__}: {e}",
            fix,
        ) from e
    hook = getattr(module, function_name, None)
    if not callable(hook):
        near = closest(
            function_name,
            [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")],
        )
        raise KeelError(
            HOOK_LOAD,
            f"{module_name!r} has no function {function_name!r}",
            f"set {replaced(f'{module_name}:{near}')}" if near else None,
        )
    return hook


def run_hooks(hooks: list[Hook], step: int, metrics: dict, batch) -> list[str]:
    warnings: list[str] = []
    for hook in hooks:
        warnings += hook(step, metrics, batch) or []
    return warnings
