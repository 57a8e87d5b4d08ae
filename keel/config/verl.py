"""verl's configuration on keel: its OmegaConf references resolved, each of its keys taken as
keel.config.verl_rules says, and its reward managers as keel's settings. No verl key gets the
generic unknown-key error.
"""

from __future__ import annotations

import os
import re
from typing import Any

from keel.config.verl_releases import earlier_releases
from keel.config.verl_rules import (
    ACCEPT,
    DERIVED,
    NO_VLLM,
    REFUSE,
    RENAME,
    UNSET_VALUES,
    VALUE_ALIASES,
    VALUE_REFUSALS,
    VERL_LOGGERS,
    quiet,
    rule_for,
)
from keel.errors import VERL_UNSUPPORTED, KeelError
from keel.errors.fixes import setting


def adapt_verl(
    tree: dict, known: set[str], defaults: dict[str, Any], problems: list, decided: list
) -> dict:
    """The tree with verl's references resolved, verl's keys taken as the rules say (kept, renamed,
    accepted with a note in `decided`, or refused into `problems`) and verl's "unset" values
    dropped. `known`: keel's own keys; `defaults`: their defaults (what a reference to a key the
    config leaves unset resolves to)."""
    flat = _flat(tree, known)
    earlier_releases(flat, decided, problems)
    flat = _renamed(flat, known, decided)
    # as verl's references derive them
    for key, source in DERIVED.items():
        if key not in flat and source in flat:
            flat[key] = flat[source]
    flat = resolve_references(flat, defaults)
    _reward_manager(flat, defaults, decided, problems)
    # verl's way to name a checkpoint
    if flat.get("trainer.resume_mode") == "resume_path":
        flat["trainer.resume_mode"] = flat.pop("trainer.resume_from_path", None) or "auto"
    return _unflat(_kept(flat, known, defaults, problems, decided))


def _kept(
    flat: dict[str, Any], known: set[str], defaults: dict[str, Any], problems: list, decided: list
) -> dict[str, Any]:
    """The keys keel reads, each value as keel takes it; verl's other keys by their rule (accepted
    with a note, refused, or, neither keel's nor verl's, left for the unknown-key error)."""
    kept: dict[str, Any] = {}
    for key, value in flat.items():
        if key == "trainer.logger":
            value = _loggers(value, decided, problems)
        if key in known:
            if isinstance(value, str) and value in VALUE_ALIASES.get(key, {}):
                decided.append(
                    f"{key}: {value} is {VALUE_ALIASES[key][value]} in keel (the same numbers)"
                )
                value = VALUE_ALIASES[key][value]
            if isinstance(value, str) and value in VALUE_REFUSALS.get(key, {}):
                problems.append(
                    KeelError(
                        VERL_UNSUPPORTED,
                        f"{key}={value!r} is a verl setting keel does not have: "
                        f"{VALUE_REFUSALS[key][value]}",
                        f"set {setting(key, defaults[key])} (keel's default; docs/config.md "
                        "lists the others)",
                    )
                )
                continue
            if any(
                value == unset and type(value) is type(unset) for unset in UNSET_VALUES.get(key, ())
            ):
                decided.append(
                    f"{key}: {value!r} is verl's; "
                    + (NO_VLLM if "rollout.name" in key else "keel's default applies")
                )
            else:
                kept.setdefault(key, value)
            continue
        rule = rule_for(key)
        if rule is None:
            # not verl's either: the unknown-key error, with a spelling suggestion
            kept[key] = value
        # only those without a new name are left (_renamed took the rest)
        elif rule.kind == RENAME:
            pass
        elif rule.kind == REFUSE and not rule.allowed(value):
            problems.append(
                KeelError(
                    VERL_UNSUPPORTED,
                    f"{key}={value!r} is a verl setting keel does not have: {rule.note}",
                    f"remove `{key}` (verl's default then applies)",
                )
            )
        elif rule.kind == ACCEPT and not quiet(key, value):
            decided.append(f"{key}: {rule.note}")
    return kept


def _renamed(flat: dict[str, Any], known: set[str], decided: list) -> dict[str, Any]:
    """Keys renamed between verl releases under their new names (a key may have been renamed twice).
    A value under the new name wins unless it is unset (null): the user's, or verl's default where
    the composed config holds both names."""
    renamed: dict[str, Any] = {}
    for key, value in flat.items():
        target, notes = key, []
        for _ in range(3):
            rule = rule_for(target) if target not in known else None
            if rule is None or rule.kind != RENAME or not rule.renamed(target):
                break
            target = rule.renamed(target)
            notes.append(rule.note)
        if target == key:
            renamed.setdefault(key, value)
            continue
        if renamed.get(target, flat.get(target)) is None:
            renamed[target] = value
            # else the new name's own rule says what keel does
            if target in known and not quiet(key, value):
                decided.append(f"{key}: is {target} ({'; '.join(notes)})")
    return renamed


def _loggers(value: Any, decided: list, problems: list) -> Any:
    """trainer.logger without verl's trackers keel has no sink for, each refused by name; verl's
    `tracking` is wandb, and `file` is keel's metrics.jsonl."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list):
        return value
    kept = []
    for name in names:
        if name == "tracking":
            decided.append("trainer.logger: tracking is verl's older name of wandb")
            kept.append("wandb")
        elif name == "file":
            decided.append(
                "trainer.logger: file, verl's JSON-lines metrics, is keel's metrics.jsonl in the "
                "run directory, written always"
            )
        elif name in VERL_LOGGERS:
            problems.append(
                KeelError(
                    VERL_UNSUPPORTED,
                    f"trainer.logger: {name!r} is a verl tracker keel has no sink "
                    f"for ({VERL_LOGGERS[name]}); keel logs to console, wandb, tensorboard and "
                    "mlflow, and writes metrics.jsonl in the run directory always",
                    f"set {setting('trainer.logger', _without(names, name))} (without {name}; "
                    "wandb, tensorboard or mlflow in its place if you want a tracker)",
                )
            )
        else:
            kept.append(name)
    return list(dict.fromkeys(kept))


def _without(names: list, refused: str) -> list:
    rest = [n for n in names if n != refused and n not in VERL_LOGGERS and n != "file"]
    return [n if n != "tracking" else "wandb" for n in rest] or ["console"]


def _reward_manager(
    flat: dict[str, Any], defaults: dict[str, Any], decided: list, problems: list
) -> None:
    """verl's reward_model.reward_manager (and its reward_kwargs) as keel's settings: naive is
    keel's way, batch is custom_reward_function.batched, dapo is reward.overlong_buffer, prime is
    scoring processes (reward.num_workers)."""
    named = [flat.pop(key, None) for key in ("reward_model.reward_manager", "reward_manager.name")]
    manager = next((name for name in named if name not in (None, "naive")), "naive")
    # an empty mapping: nothing to pass
    flat.pop("reward_model.reward_kwargs", None)
    kwargs = {
        key.removeprefix("reward_model.reward_kwargs."): flat.pop(key)
        for key in list(flat)
        if key.startswith("reward_model.reward_kwargs.")
    }
    if manager == "batch":
        flat.setdefault("custom_reward_function.batched", True)
    elif manager == "prime":
        flat.setdefault("reward.num_workers", min(8, os.cpu_count() or 1))
    elif manager != "naive" and manager != "dapo":
        problems.append(
            KeelError(
                VERL_UNSUPPORTED,
                f"reward_model.reward_manager={manager!r} is a verl reward manager keel does "
                "not have",
                f"set {setting('reward_model.reward_manager', 'naive')} (keel's default), or "
                "batch, dapo or prime",
            )
        )
    if manager != "naive":
        decided.append(
            f"reward_model.reward_manager: {manager}, as keel's "
            + {
                "batch": "custom_reward_function.batched=true",
                "prime": "reward.num_workers scoring processes",
                "dapo": "reward.overlong_buffer (reward_kwargs.overlong_buffer_cfg)",
            }.get(manager, manager)
        )
    _reward_kwargs(kwargs, manager, flat, defaults, problems)


def _reward_kwargs(
    kwargs: dict[str, Any], manager: str, flat: dict[str, Any], defaults: dict, problems: list
) -> None:
    """The reward manager's reward_kwargs: DAPO's overlong_buffer_cfg as reward.overlong_buffer;
    max_resp_len only as data.max_response_length; any other refused by name."""
    for key, value in kwargs.items():
        option = key.removeprefix("overlong_buffer_cfg.")
        if key.startswith("overlong_buffer_cfg.") and option in ("enable", "len", "penalty_factor"):
            flat[f"reward.overlong_buffer.{option}"] = value
        elif key == "max_resp_len" and value not in (
            None,
            flat.get("data.max_response_length", defaults.get("data.max_response_length")),
        ):
            problems.append(
                KeelError(
                    VERL_UNSUPPORTED,
                    f"reward_model.reward_kwargs.max_resp_len={value} differs "
                    "from data.max_response_length; keel's overlong penalty measures against "
                    "data.max_response_length",
                    "remove `reward_model.reward_kwargs.max_resp_len` (the penalty measures "
                    "against data.max_response_length)",
                )
            )
        # keel logs the penalty always
        elif key not in ("max_resp_len", "overlong_buffer_cfg.log"):
            problems.append(
                KeelError(
                    VERL_UNSUPPORTED,
                    f"reward_model.reward_kwargs.{key} is not an argument of "
                    f"verl's {manager} reward manager that keel has",
                    f"remove `reward_model.reward_kwargs.{key}`; "
                    "custom_reward_function.reward_kwargs reach your function",
                )
            )


def _flat(tree: dict, known: set[str], prefix: str = "") -> dict[str, Any]:
    """Dotted keys down to keel's leaves (a dict-valued leaf, like reward.scorers, stays whole)."""
    flat = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and dotted not in known:
            flat.update(_flat(value, known, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _unflat(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


_REFERENCE = re.compile(r"\$\{(oc\.select:)?\s*([^,}]+?)\s*(?:,\s*([^}]*))?\}")


def resolve_references(
    flat: dict[str, Any], defaults: dict[str, Any] | None = None
) -> dict[str, Any]:
    """verl's OmegaConf references in values: `${a.b}`, `${oc.select:a.b,default}`, `${.x}` (a
    sibling) and `${..x}` (a parent's), within strings too (`checkpoints/${trainer.project_name}`);
    `~/` paths expanded. A reference to a key the config leaves unset takes keel's default for it,
    else the reference's own default, else stays unset (None)."""
    defaults = defaults or {}

    def value_of(key: str, at: str, default: str | None, depth: int) -> Any:
        if key.startswith("."):
            dots = len(key) - len(key.lstrip("."))
            key = ".".join(at.split(".")[:-dots] + [key.lstrip(".")])
        if key in flat and depth < 8:
            return resolve(flat[key], key, depth + 1)
        if key in defaults:
            return defaults[key]
        return None if default is None or default.strip() == "null" else _scalar(default)

    def resolve(value: Any, at: str, depth: int = 0) -> Any:
        if isinstance(value, list):
            return [resolve(item, at, depth) for item in value]
        if not isinstance(value, str):
            return value
        whole = _REFERENCE.fullmatch(value.strip())
        if whole:
            return value_of(whole.group(2), at, whole.group(3), depth)
        value = _REFERENCE.sub(lambda m: str(value_of(m.group(2), at, m.group(3), depth)), value)
        return os.path.expanduser(value) if value.startswith("~/") else value

    return {key: resolve(value, key) for key, value in flat.items()}


def _scalar(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text.strip().strip('"').strip("'"))
    except yaml.YAMLError:
        return text
