"""A config value as its field takes it: a YAML value made the field's type (`coerce`), then checked
against the field's choices and bounds (`check_field`); each refusal says what to set instead."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from keel.errors import BAD_VALUE, KeelError
from keel.errors.fixes import closest, setting


def value_at(cfg, dotted: str):
    """The value of a dotted key (`trainer.mode`) in a config tree."""
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def field_default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def coerce(value: Any, target, dotted: str):
    """Convert a YAML value to the field's type; reject what cannot be converted."""
    origin = typing.get_origin(target)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(target) if a is not type(None)]
        if value is None:
            return None
        return coerce(value, args[0], dotted)
    # free-form keys (e.g. data_source -> scorer weights); values are typed
    if origin is dict:
        key_type, value_type = typing.get_args(target)
        if not isinstance(value, dict):
            _bad_type(dotted, value, "a mapping")
        return {
            coerce(k, key_type, dotted): coerce(v, value_type, f"{dotted}.{k}")
            for k, v in value.items()
        }
    if origin is list:
        (item_type,) = typing.get_args(target)
        items = [value] if isinstance(value, (str, int, float)) else value
        if not isinstance(items, (list, tuple)):
            _bad_type(dotted, value, "a list")
        return [coerce(v, item_type, f"{dotted}[{i}]") for i, v in enumerate(items)]
    if target is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        _bad_type(dotted, value, "true or false")
    if target is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            _bad_type(dotted, value, "an integer")
        return int(value)
    if target is float:
        if isinstance(value, str):
            try:
                # YAML reads `1e-6` (no dot) as a string
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _bad_type(dotted, value, "a number")
        return float(value)
    if target is str:
        if value is None or isinstance(value, (dict, list)):
            _bad_type(dotted, value, "a string")
        return str(value)
    return value


def _bad_type(dotted: str, value: Any, expected: str):
    """The fix (the key's default) is added by keel.config.load._build, which knows the field."""
    raise KeelError(BAD_VALUE, f"{dotted}={value!r} must be {expected}")


def check_field(f: dataclasses.Field, value: Any, dotted: str):
    meta = f.metadata
    if value is None:
        return value
    choices = meta.get("choices")
    for item in value if isinstance(value, list) else [value]:
        if choices and item not in choices:
            raise KeelError(
                BAD_VALUE,
                f"{dotted}: {item!r} is not one of {list(choices)}",
                _choice_fix(dotted, value, item, choices, field_default(f)),
            )
    for bound, ok, word in (
        ("ge", lambda v, b: v >= b, ">="),
        ("gt", lambda v, b: v > b, ">"),
        ("le", lambda v, b: v <= b, "<="),
    ):
        b = meta.get(bound)
        if b is not None and isinstance(value, (int, float)) and not ok(value, b):
            # the nearest allowed
            near = b if bound != "gt" else b + 1 if isinstance(value, int) else field_default(f)
            raise KeelError(
                BAD_VALUE,
                f"{dotted}={value} must be {word} {b}",
                f"set {setting(dotted, near)} (the "
                + ("default)" if near == field_default(f) else "nearest value allowed)"),
            )
    return value


def _choice_fix(dotted: str, value: Any, item: Any, choices, default: Any) -> str:
    """The choice `item` is a misspelling of, else the default (for a list: without the item)."""
    near = closest(str(item), choices)
    if isinstance(value, list):
        fixed = (
            [near if v == item else v for v in value] if near else [v for v in value if v != item]
        )
        why = f"{item!r} spelt as the choice" if near else f"without {item!r}"
        return (
            f"set {setting(dotted, fixed)} ({why}; the choices are {', '.join(map(str, choices))})"
        )
    why = "the choice spelt like it" if near else "the default"
    return (
        f"set {setting(dotted, near or default)} ({why}; the choices are "
        f"{', '.join(map(str, choices))})"
    )
