"""verl's custom_reward_function: the user's file (a path or `file://FILE`) or module
(`pkg://package.module`) imported, the named function found in it, and its signature checked
against the call keel makes."""

from __future__ import annotations

import functools
from pathlib import Path

from keel.errors import REWARD_FN_LOAD, KeelError
from keel.errors.fixes import closest, nearby_file, setting
from keel.rewards.contract import BATCHED, PER_SAMPLE, RewardFn, check_signature
from keel.rewards.worker import FILE_PREFIX, PKG_PREFIX, load_module


def load_custom_reward_fn(
    path: str, name: str, reward_kwargs: dict | None = None, batched: bool = False
) -> RewardFn:
    """Import `name` from `path` (verl's custom_reward_function: a python file, `file://FILE` or
    `pkg://package.module`), with `reward_kwargs` bound to every call; refuse a function verl's
    keyword call could not bind."""
    module = _import_reward_module(path)
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(
            k
            for k, v in vars(module).items()
            if callable(v)
            and not k.startswith("_")
            and getattr(v, "__module__", None) == module.__name__
            # its own, not what it imported
        )
        near = closest(name, found) or (found[0] if len(found) == 1 else None)
        raise KeelError(
            REWARD_FN_LOAD,
            f"{path} has no function {name!r} (it defines: {found})",
            f"set {setting('custom_reward_function.name', near)}"
            if near
            else f"set custom_reward_function.name to one of {found}",
        )
    fn = functools.partial(fn, **reward_kwargs) if reward_kwargs else fn
    check_signature(fn, BATCHED if batched else PER_SAMPLE, path, name)
    return fn


def _import_reward_module(path: str):
    if path.startswith(PKG_PREFIX):
        return _import_package_module(path)
    file = Path(path.removeprefix(FILE_PREFIX))
    if not file.is_file():
        found = nearby_file(str(file), (".py",))
        raise KeelError(
            REWARD_FN_LOAD,
            f"custom_reward_function.path={path!r} does not exist",
            f"set {setting('custom_reward_function.path', found)} (the file there named most "
            "like it)"
            if found
            else None,
        )
    try:
        return load_module(str(file))
    # the user's file: any import-time error is theirs to fix
    except Exception as e:
        raise KeelError(REWARD_FN_LOAD, f"importing {path} failed: {type(e).__name__}: {e}") from e


def _import_package_module(path: str):
    try:
        return load_module(path)
    except ModuleNotFoundError as e:
        raise KeelError(
            REWARD_FN_LOAD,
            f"custom_reward_function.path={path!r}: no module named {e.name!r} is importable here",
            "install the package that holds it (pip install -e <its checkout>), "
            "add its directory to PYTHONPATH, or set custom_reward_function.path to the module's "
            "file",
        ) from e
    # the user's module: any import-time error is theirs to fix
    except Exception as e:
        raise KeelError(REWARD_FN_LOAD, f"importing {path} failed: {type(e).__name__}: {e}") from e
