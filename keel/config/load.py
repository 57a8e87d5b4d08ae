"""Build a config tree (`KeelConfig`, `SFTConfig`) from YAML, a dict or an object, plus overrides.

Unknown keys are errors that name the closest valid key: a misspelt key silently ignored is one of
the traps keel exists to remove.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from keel.config.hydra_compose import VerlLaunch, compose_launch
from keel.config.overrides import DELETE, apply_overrides
from keel.config.plan import Plan, plan_of
from keel.config.preference import OBJECTIVES
from keel.config.rules import check_config
from keel.config.schema import KeelConfig
from keel.config.values import check_field, coerce, field_default
from keel.config.verl import adapt_verl
from keel.errors import (
    BAD_VALUE,
    CATALOGUE,
    CONFIG_FILE,
    REFERENCE_APART,
    UNKNOWN_KEY,
    UNKNOWN_OBJECTIVE,
    KeelError,
)
from keel.errors.fixes import nearby_file, setting, value_text


class Run(NamedTuple):
    """A loaded RL config and keel's plan for it: `cfg, plan = load_run(...)`."""

    config: KeelConfig
    plan: Plan


def load_run(
    source: str | Path | dict | Any | None = None,
    overrides: list[str] | dict[str, Any] | None = None,
) -> Run:
    """`load_config` for RL, with the plan of what keel decides for the config (made once, here:
    the config itself is never written to)."""
    loaded = _load(source, overrides, KeelConfig)
    return Run(loaded.config, plan_of(loaded.config, loaded.given, loaded.decided, loaded.adapted))


def objective_of(
    source: str | Path | dict | Any | None, overrides: list[str] | dict[str, Any] | None = None
) -> str | None:
    """The `objective` a `keel train` config names (preference training), or None for RL."""
    value = _as_tree(source)[0].get("objective")
    items = (
        overrides.items()
        if isinstance(overrides, dict)
        else (item.split("=", 1) for item in overrides or [] if "=" in item)
    )
    for key, given in items:
        if key.lstrip("+") == "objective":
            value = given
    if value is None:
        return None
    if value not in OBJECTIVES:
        raise KeelError(
            UNKNOWN_OBJECTIVE,
            f"objective={value!r} is not a training objective keel knows ({', '.join(OBJECTIVES)})",
            f"set {setting('objective', 'dpo')} (DPO) or "
            f"{setting('objective', 'reward_model')}, or remove the key for RL",
        )
    return value


def load_config(
    source: str | Path | dict | Any | None = None,
    overrides: list[str] | dict[str, Any] | None = None,
    schema: type = KeelConfig,
):
    """The one way to get a validated config: from a YAML path, a nested dict or a config object.

    `schema` is the root dataclass (KeelConfig for RL, SFTConfig for SFT). The rules that span
    several keys are checked here (keel.config.rules for RL, SFTConfig.validate for SFT). verl's
    keys and values are taken as keel.config.verl says; every problem of the config is reported at
    once. What keel took for the user (verl keys it does another way, verl's "unset" values) is the
    plan's (`load_run`). `VerlLaunch` is verl's `--config-path/--config-name` form; a YAML file with
    a `defaults:` list is composed the same way."""
    return _load(source, overrides, schema).config


@dataclass(frozen=True)
class _Loaded:
    config: Any
    # the keys the source and overrides set
    given: frozenset[str]
    # the keys set once verl's were read under keel's names
    adapted: frozenset[str]
    decided: tuple[str, ...]


def _load(source, overrides, schema: type) -> _Loaded:
    tree, decided = _as_tree(source)
    apply_overrides(tree, overrides, _value_now(tree, schema))
    problems: list[KeelError] = []
    given = frozenset(flatten(tree))
    # verl's SFT trainer has keys of its own; keel's SFT keys are checked as they are
    if schema is KeelConfig:
        tree = adapt_verl(tree, _known_keys(schema), _defaults(schema), problems, decided)
    cfg = _build(schema, tree, prefix="", schema=schema, problems=problems, decided=decided)
    if problems:
        raise combined(problems)
    # the rules that span several keys: RL's in keel.config.rules, SFT's its own
    if schema is KeelConfig:
        check_config(cfg)
    else:
        cfg.validate()
    return _Loaded(cfg, given, frozenset(flatten(tree)), tuple(decided))


def combined(problems: list[KeelError]) -> KeelError:
    """One error for every problem of a config: the first's code; each listed with its own."""
    if len(problems) == 1:
        return problems[0]
    lines = "\n".join(f"  error[{p.code}]: {p.message}\n    fix: {p.fix}" for p in problems)
    options = [p.fix.split("`")[1] if p.fix.startswith("set `") else None for p in problems]
    fix = (
        f"set `{' '.join(options)}` (every line's fix)"
        if all(options) and len(set(options)) == len(options)
        else "fix each as its line says"
    )
    return KeelError(
        problems[0].code, f"{len(problems)} problems in the config, all of them here:\n{lines}", fix
    )


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


def changed_keys(
    saved: dict, current: dict, may_change: tuple[str, ...], defaults: dict | None = None
) -> list[str]:
    """`key: old -> new` for every key that differs, except keys starting with a `may_change` entry.
    A key the saved config lacks (added by a newer keel) is unchanged if it holds its default."""
    old, new = flatten(saved), flatten(current)
    for key, value in flatten(defaults or {}).items():
        old.setdefault(key, value)
    return [
        f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        for key in sorted(set(old) | set(new))
        if old.get(key) != new.get(key) and not key.startswith(may_change)
    ]


@functools.cache
def _known_keys(schema: type) -> frozenset[str]:
    return frozenset(all_keys(schema))


@functools.cache
def _defaults(schema: type) -> dict[str, Any]:
    """Every key's default (read only: shared between loads)."""
    return flatten(to_dict(schema()))


def all_keys(cls: type = KeelConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the tree, e.g. `actor_rollout_ref.actor.ppo_mini_batch_size`."""
    keys = []
    for f in dataclasses.fields(cls):
        dotted = f"{prefix}{f.name}"
        sub = _dataclass_type(f.type, cls)
        keys.extend(all_keys(sub, dotted + ".") if sub else [dotted])
    return keys


# --- sources and overrides ---------------------------------------------------------------------


def _as_tree(source) -> tuple[dict, list[str]]:
    """The source's tree, and what keel decided while reading it (for `keel check`'s list)."""
    if source is None:
        return {}, []
    if isinstance(source, VerlLaunch):
        return compose_launch(source)
    if dataclasses.is_dataclass(source):
        return to_dict(source), []
    if isinstance(source, dict):
        return _deep_copy(source), []
    tree = _yaml_file(Path(source))
    # a Hydra config (verl's examples): composed as Hydra would
    if isinstance(tree.get("defaults"), list):
        return compose_launch(VerlLaunch(str(Path(source).parent), Path(source).stem))
    return tree, []


def _yaml_file(path: Path) -> dict:
    if not path.is_file():
        raise KeelError(
            CONFIG_FILE, f"config file {str(path)!r} does not exist", _config_file_fix(str(path))
        )
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise KeelError(CONFIG_FILE, f"{path} is not valid YAML: {e}") from e
    if not isinstance(tree, dict):
        raise KeelError(
            CONFIG_FILE, f"{path} must hold a mapping of sections, got {type(tree).__name__}"
        )
    return tree


def _config_file_fix(missing: str) -> str | None:
    found = nearby_file(missing, (".yaml", ".yml"))
    if found:
        return f"pass `{found}` in place of `{missing}` (the YAML file there named most like it)"
    folder = next(
        (p for p in [Path(missing).parent, *Path(missing).parent.parents] if p.is_dir()), Path(".")
    )
    present = sorted(p.name for p in folder.glob("*.y*ml"))
    return f"pass the path of an existing YAML file ({folder} holds {present or 'none'})"


def _value_now(tree: dict, schema: type):
    """key -> the value a key holds before the overrides (the file's, else the default), or None."""
    flat = flatten(tree)
    return lambda key: flat[key] if key in flat else _defaults(schema).get(key, DELETE)


def _deep_copy(tree: dict) -> dict:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in tree.items()}


# --- building the typed tree -------------------------------------------------------------------


def _build(cls: type, tree: Any, prefix: str, schema: type, problems: list, decided: list):
    """The typed tree; what is wrong is added to `problems` and its key left at the default."""
    if not isinstance(tree, dict):
        problems.append(
            KeelError(
                BAD_VALUE, f"{prefix.rstrip('.') or 'config'} must be a mapping, got {tree!r}"
            )
        )
        return cls()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in tree.items():
        dotted = f"{prefix}{name}"
        try:
            if name not in fields:
                _unknown_key(dotted + _first_leaf(value), schema, _leaf_value(value))
            f = fields[name]
            sub = _dataclass_type(f.type, cls)
            if sub is not None:
                kwargs[name] = _build(
                    sub, value if value is not None else {}, dotted + ".", schema, problems, decided
                )
            # verl's null: "not set"
            elif value is None and not _optional(_resolve(f.type, cls)):
                decided.append(f"{dotted}: null, so keel's default {field_default(f)!r}")
            else:
                kwargs[name] = check_field(f, coerce(value, _resolve(f.type, cls), dotted), dotted)
        except KeelError as problem:
            # a value of the wrong type
            if problem.code == BAD_VALUE and problem.fix == CATALOGUE[BAD_VALUE].fix:
                problem = KeelError(
                    BAD_VALUE,
                    problem.message,
                    f"set {setting(dotted, field_default(fields[name]))} (the default)",
                )
            problems.append(problem)
    return cls(**kwargs)


def _optional(annotation) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(
        None
    ) in typing.get_args(annotation)


def _leaf_value(value: Any) -> Any:
    """The value at _first_leaf's key."""
    return _leaf_value(next(iter(value.values()))) if isinstance(value, dict) and value else value


def _first_leaf(value: Any) -> str:
    """`.a.b` for {'a': {'b': 1}}, so a wrong section still shows the key the user meant."""
    if isinstance(value, dict) and value:
        key, sub = next(iter(value.items()))
        return f".{key}{_first_leaf(sub)}"
    return ""


# Placement keys a user might expect for the reference model (the critic and the reward model
# have them): refused with the reason instead of a spelling suggestion.
REFERENCE_PLACEMENT = {
    f"actor_rollout_ref.ref.{key}" for key in ("enable_resource_pool", "n_gpus_per_node", "nnodes")
}


def _unknown_key(dotted: str, schema: type, value: Any):
    if dotted in REFERENCE_PLACEMENT:
        raise KeelError(
            REFERENCE_APART,
            f"{dotted}: the reference model always shares the actor's workers, "
            "because their log-probs are compared token by token every step",
            f"remove `{dotted}`; to make room on 2 or more workers, set "
            "`actor_rollout_ref.ref.fsdp_config.param_offload=true`",
        )
    valid = sorted(_known_keys(schema))
    # A right key under a missing section (`actor.ppo_epochs`) is matched by its suffix first; else
    # only a misspelling is suggested (a few letters off, in the same section): a near name that
    # means another thing (use_remove_padding -> trust_remote_code) is worse than no suggestion.
    close = [k for k in valid if k.endswith("." + dotted)][:1]
    close = (
        close
        or [
            k
            for k in difflib.get_close_matches(dotted, valid, n=3, cutoff=0.8)
            if _misspelt(dotted, k)
        ][:1]
    )
    hint = f"did you mean {close[0]!r}?" if close else "see the README for the list of keys"
    raise KeelError(
        UNKNOWN_KEY,
        f"unknown config key {dotted!r}; {hint}",
        f"write `{close[0]}={value_text(value)}` in place of `{dotted}={value_text(value)}`"
        if close
        else f"remove `{dotted}` (no key is spelt like it; docs/config.md lists every key)",
    )


def _misspelt(typed: str, key: str) -> bool:
    """`typed` is `key` with at most two letters changed, added, dropped or swapped, in its leaf."""
    (section, leaf), (key_section, key_leaf) = typed.rpartition(".")[::2], key.rpartition(".")[::2]
    return section == key_section and _edits(leaf, key_leaf) <= 2


def _edits(a: str, b: str) -> int:
    """Optimal string alignment distance (a swap of two neighbours is one edit)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(
                d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1])
            )
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


def _resolve(annotation, owner: type):
    if isinstance(annotation, str):
        hints = typing.get_type_hints(owner)
        return hints[next(f.name for f in dataclasses.fields(owner) if f.type == annotation)]
    return annotation


def _dataclass_type(annotation, owner: type):
    resolved = _resolve(annotation, owner)
    return resolved if dataclasses.is_dataclass(resolved) else None
