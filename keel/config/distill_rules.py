"""The distillation section's cross-field rules: a teacher when distillation is on, and no setting
the run never reads (a setting keel ignores in silence is a trap). Each raises KEEL-C028 with the
setting that reads it, or the key to remove."""

from __future__ import annotations

import dataclasses
from typing import Any

from keel.config.distill import DistillationConfig
from keel.config.schema import KeelConfig
from keel.errors import DISTILLATION_OPTION, KeelError
from keel.errors.fixes import setting, value_text

SECTION = "distillation"


def check_distillation(cfg: KeelConfig) -> None:
    d = cfg.distillation
    changed = changed_settings(d, DistillationConfig(), SECTION + ".")
    if not d.enable:
        _refuse_unread(
            changed,
            "set while distillation.enable=false: no teacher runs, so nothing reads it",
            # a teacher named: distilling from it is what was most likely meant
            setting(SECTION + ".enable", True) if d.teacher.path else None,
        )
        return
    if not d.teacher.path:
        raise KeelError(
            DISTILLATION_OPTION,
            "distillation.enable=true but distillation.teacher.path is empty: there is no teacher "
            "to score the student's samples",
            "set distillation.teacher.path to the teacher's local Hugging Face model directory "
            "(a causal LM whose tokenizer is the student's), or "
            f"{setting(SECTION + '.enable', False)} to train without one",
        )
    _refuse_unread_task_reward(cfg)
    unread_by_mode = (
        {key: value for key, value in changed.items() if key.startswith(SECTION + ".gkd.")}
        if d.mode == "reverse_kl"
        else {key: value for key, value in changed.items() if key == SECTION + ".kl_estimator"}
    )
    other = "gkd" if d.mode == "reverse_kl" else "reverse_kl"
    _refuse_unread(
        unread_by_mode,
        f"read by distillation.mode={other} only, and this run's mode is {d.mode}",
        setting(SECTION + ".mode", other),
    )
    # the reference responses: read by gkd's share of steps on the data (lmbda < 1) only
    if not (d.mode == "gkd" and d.gkd.lmbda < 1):
        _refuse_unread(
            {k: v for k, v in changed.items() if k == SECTION + ".response_key"},
            "read only by distillation.mode=gkd with gkd.lmbda < 1 (its steps on the data's "
            "responses)",
            None,
        )
    if not d.teacher.enable_resource_pool:
        _refuse_unread(
            {
                key: value
                for key, value in changed.items()
                if key in (SECTION + ".teacher.n_gpus_per_node", SECTION + ".teacher.nnodes")
            },
            "the size of the teacher's own pool, and distillation.teacher.enable_resource_pool="
            "false places the teacher beside the policy",
            setting(SECTION + ".teacher.enable_resource_pool", True),
        )


def _refuse_unread_task_reward(cfg: KeelConfig) -> None:
    """What acts on the task's rewards alone, where task_reward_coef=0 leaves them out of the
    signal: algorithm.use_kl_in_reward's penalty (computed, then dropped) and filter_groups (which
    would drop groups the teacher teaches, whatever their rewards)."""
    a = cfg.algorithm
    if cfg.distillation.task_reward_coef > 0:
        return
    if a.use_kl_in_reward:
        raise KeelError(
            DISTILLATION_OPTION,
            "algorithm.use_kl_in_reward=true with distillation.task_reward_coef=0: the KL penalty "
            "is part of the task's reward, whose advantage a coefficient of 0 leaves out, so the "
            "reference would be run for nothing",
            f"set {setting('actor_rollout_ref.actor.use_kl_loss', True)} (the KL to the "
            "reference as a loss, beside the teacher's signal), or a "
            "distillation.task_reward_coef above 0, or remove `algorithm.use_kl_in_reward`",
        )
    if a.filter_groups.enable:
        raise KeelError(
            DISTILLATION_OPTION,
            "algorithm.filter_groups.enable=true with distillation.task_reward_coef=0: dynamic "
            "sampling drops the groups whose rewards are all alike, but the rewards teach nothing "
            "here and the teacher teaches every group, so it would discard samples the teacher "
            "scores (every one, under a constant reward)",
            f"set {setting('algorithm.filter_groups.enable', False)}, or a "
            "distillation.task_reward_coef above 0 (the rewards then teach too)",
        )


def changed_settings(section: Any, default: Any, prefix: str) -> dict[str, Any]:
    """`dotted key -> value` of every leaf of `section` that differs from `default`'s."""
    changed = {}
    for field in dataclasses.fields(section):
        value, default_value = getattr(section, field.name), getattr(default, field.name)
        if dataclasses.is_dataclass(value):
            changed |= changed_settings(value, default_value, f"{prefix}{field.name}.")
        elif value != default_value:
            changed[prefix + field.name] = value
    return changed


def _refuse_unread(unread: dict[str, Any], why: str, reader: str | None) -> None:
    """KEEL-C028 for settings nothing reads: the fix is the setting that reads them (`reader`),
    or removing them."""
    if not unread:
        return
    given = ", ".join(f"{key}={value_text(value)}" for key, value in unread.items())
    remove = ", ".join(f"remove `{key}`" for key in unread)
    raise KeelError(
        DISTILLATION_OPTION,
        f"{given}: {why}",
        f"set {reader} (which reads {'it' if len(unread) == 1 else 'them'}), or {remove}"
        if reader
        else remove,
    )
