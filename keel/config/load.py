"""Build a config tree (`KeelConfig`, `SFTConfig`) from YAML, a dict or an object, plus overrides.

Unknown keys are errors that name the closest valid key: a misspelt key silently ignored is one of
the traps keel exists to remove.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from keel.config.schema import KeelConfig
from keel.errors import BAD_OVERRIDE, BAD_VALUE, CONFIG_FILE, REFERENCE_APART, UNKNOWN_KEY, KeelError



def load_config(source: str | Path | dict | Any | None = None,
                overrides: list[str] | dict[str, Any] | None = None, schema: type = KeelConfig):
    """The one way to get a validated config: from a YAML path, a nested dict or a config object.

    `schema` is the root dataclass (KeelConfig for RL, SFTConfig for SFT); its `validate()` checks
    the rules that span several keys.
    """
    tree = _as_tree(source)
    for key, value in _parse_overrides(overrides):
        _set_dotted(tree, key, value)
    cfg = _build(schema, tree, prefix="", schema=schema)
    cfg.validate()
    return cfg


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}"""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def changed_keys(saved: dict, current: dict, may_change: tuple[str, ...], defaults: dict | None = None) -> list[str]:
    """`key: old -> new` for every key that differs, except keys starting with a `may_change` entry.
    A key the saved config lacks (added by a newer keel) is unchanged if it holds its default."""
    old, new = flatten(saved), flatten(current)
    for key, value in flatten(defaults or {}).items():
        old.setdefault(key, value)
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(set(old) | set(new))
            if old.get(key) != new.get(key) and not key.startswith(may_change)]


def all_keys(cls: type = KeelConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the tree, e.g. `actor_rollout_ref.actor.ppo_mini_batch_size`."""
    keys = []
    for f in dataclasses.fields(cls):
        dotted = f"{prefix}{f.name}"
        sub = _dataclass_type(f.type, cls)
        keys.extend(all_keys(sub, dotted + ".") if sub else [dotted])
    return keys


# --- sources and overrides ---------------------------------------------------------------------

def _as_tree(source) -> dict:
    if source is None:
        return {}
    if dataclasses.is_dataclass(source):
        return to_dict(source)
    if isinstance(source, dict):
        return _deep_copy(source)
    path = Path(source)
    if not path.is_file():
        raise KeelError(CONFIG_FILE, f"config file {str(path)!r} does not exist")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise KeelError(CONFIG_FILE, f"{path} is not valid YAML: {e}") from e
    if not isinstance(tree, dict):
        raise KeelError(CONFIG_FILE, f"{path} must hold a mapping of sections, got {type(tree).__name__}")
    return tree


def _deep_copy(tree: dict) -> dict:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in tree.items()}


def _parse_overrides(overrides) -> list[tuple[str, Any]]:
    if not overrides:
        return []
    if isinstance(overrides, dict):
        return list(overrides.items())
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip().lstrip("+")  # Hydra's `+key=value` means "add"; every key exists here
        if not sep or not key:
            raise KeelError(BAD_OVERRIDE, f"override {item!r} is not of the form section.key=value")
        parsed.append((key, yaml.safe_load(raw) if raw.strip() else None))
    return parsed


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value


# --- building the typed tree -------------------------------------------------------------------

def _build(cls: type, tree: Any, prefix: str, schema: type):
    if not isinstance(tree, dict):
        raise KeelError(BAD_VALUE, f"{prefix.rstrip('.') or 'config'} must be a mapping, got {tree!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in tree.items():
        if key not in fields:
            _unknown_key(f"{prefix}{key}" + _first_leaf(value), schema)
    kwargs = {}
    for name, value in tree.items():
        f = fields[name]
        dotted = f"{prefix}{name}"
        sub = _dataclass_type(f.type, cls)
        if sub is not None:
            kwargs[name] = _build(sub, value if value is not None else {}, dotted + ".", schema)
        else:
            kwargs[name] = _check_field(f, _coerce(value, _resolve(f.type, cls), dotted), dotted)
    return cls(**kwargs)


def _first_leaf(value: Any) -> str:
    """`.a.b` for {'a': {'b': 1}}, so a wrong section still shows the key the user meant."""
    if isinstance(value, dict) and value:
        key, sub = next(iter(value.items()))
        return f".{key}{_first_leaf(sub)}"
    return ""


# Placement keys a user might expect for the reference model (the critic and the reward model
# have them): refused with the reason instead of a spelling suggestion.
REFERENCE_PLACEMENT = {f"actor_rollout_ref.ref.{key}" for key in ("enable_resource_pool", "n_gpus_per_node", "nnodes")}


def _unknown_key(dotted: str, schema: type):
    if dotted in REFERENCE_PLACEMENT:
        raise KeelError(REFERENCE_APART, f"{dotted}: the reference model always shares the actor's workers, "
                        "because their log-probs are compared token by token every step",
                        f"remove {dotted}; to make room on 2 or more workers, set "
                        "actor_rollout_ref.ref.fsdp_config.param_offload=true")
    valid = all_keys(schema)
    # A right key under a missing section (`actor.ppo_epochs`) is matched by its suffix first.
    close = [k for k in valid if k.endswith("." + dotted)][:1]
    close = close or difflib.get_close_matches(dotted, valid, n=1, cutoff=0.6)
    if not close:  # the section may be wrong but the leaf right: match on the last part
        leaf = dotted.rsplit(".", 1)[-1]
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in valid}
        close = [by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)]
    hint = f"did you mean {close[0]!r}?" if close else "see the README for the list of keys"
    raise KeelError(UNKNOWN_KEY, f"unknown config key {dotted!r}; {hint}",
                    f"replace {dotted!r} with {close[0]!r}" if close else None)


def _resolve(annotation, owner: type):
    if isinstance(annotation, str):
        hints = typing.get_type_hints(owner)
        return hints[next(f.name for f in dataclasses.fields(owner) if f.type == annotation)]
    return annotation


def _dataclass_type(annotation, owner: type):
    resolved = _resolve(annotation, owner)
    return resolved if dataclasses.is_dataclass(resolved) else None


def _coerce(value: Any, target, dotted: str):
    """Convert a YAML value to the field's type; reject what cannot be converted."""
    origin = typing.get_origin(target)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(target) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], dotted)
    if origin is dict:  # free-form keys (e.g. data_source -> scorer weights); values are typed
        key_type, value_type = typing.get_args(target)
        if not isinstance(value, dict):
            _bad_type(dotted, value, "a mapping")
        return {_coerce(k, key_type, dotted): _coerce(v, value_type, f"{dotted}.{k}") for k, v in value.items()}
    if origin is list:
        (item_type,) = typing.get_args(target)
        items = [value] if isinstance(value, (str, int, float)) else value
        if not isinstance(items, (list, tuple)):
            _bad_type(dotted, value, "a list")
        return [_coerce(v, item_type, f"{dotted}[{i}]") for i, v in enumerate(items)]
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
                return float(value)  # YAML reads `1e-6` (no dot) as a string
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
    raise KeelError(BAD_VALUE, f"{dotted}={value!r} must be {expected}", f"set {dotted} to {expected}")


def _check_field(f: dataclasses.Field, value: Any, dotted: str):
    meta = f.metadata
    if value is None:
        return value
    choices = meta.get("choices")
    for item in value if isinstance(value, list) else [value]:
        if choices and item not in choices:
            raise KeelError(BAD_VALUE, f"{dotted}: {item!r} is not one of {list(choices)}",
                            f"set {dotted} to one of {', '.join(map(str, choices))}")
    for bound, ok, word in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                            ("le", lambda v, b: v <= b, "<=")):
        b = meta.get(bound)
        if b is not None and isinstance(value, (int, float)) and not ok(value, b):
            raise KeelError(BAD_VALUE, f"{dotted}={value} must be {word} {b}",
                            f"set {dotted} to a value {word} {b}")
    return value
