"""Command-line overrides (`section.key=value`, Hydra's `~key`, `+key`, `++key`) applied to a
config tree before it is typed."""

from __future__ import annotations

from typing import Any

import yaml

from keel.errors import BAD_OVERRIDE, KeelError
from keel.errors.fixes import value_text


def apply_overrides(tree: dict, overrides, value_now) -> None:
    """Each override set in (or, `~key`, removed from) `tree`; `value_now(key)`: what a key holds
    before them, for the fix of a malformed one."""
    for key, value in parse_overrides(overrides, value_now):
        _delete_dotted(tree, key) if value is DELETE else _set_dotted(tree, key, value)


def parse_overrides(overrides, value_now=lambda key: DELETE) -> list[tuple[str, Any]]:
    if not overrides:
        return []
    if isinstance(overrides, dict):
        return [
            (key[1:], DELETE) if key.startswith("~") else (key.lstrip("+"), value)
            for key, value in overrides.items()
        ]
    parsed = []
    for item in overrides:
        # Hydra's `~key` (or `~key=value`): remove it, keel's default applies
        if item.startswith("~"):
            parsed.append((item[1:].partition("=")[0].strip(), DELETE))
            continue
        key, sep, raw = item.partition("=")
        # Hydra's `+key=value` / `++key=value` add or force
        key = key.strip().lstrip("+").lstrip("~")
        if not sep or not key:
            now = value_now(key) if key else DELETE
            fix = (
                f"write it as key=value: `{key}={value_text(now)}` in place of `{item}` (the "
                "value it has now)"
                if now is not DELETE
                else f"remove `{item}` (no key is named so); write overrides as `section.key=value`"
            )
            raise KeelError(
                BAD_OVERRIDE, f"override {item!r} is not of the form section.key=value", fix
            )
        parsed.append((key, yaml.safe_load(raw) if raw.strip() else None))
    return parsed


# an override that removes its key
DELETE = object()


def _delete_dotted(tree: dict, dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(leaf, None)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value
