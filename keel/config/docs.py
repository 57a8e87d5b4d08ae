"""Render the reference of every config key (docs/config.md): `python -m keel.config.docs`."""

from __future__ import annotations

import dataclasses
import typing

from keel.config.preference import PreferenceConfig
from keel.config.schema import KeelConfig
from keel.config.sft import SFTConfig


def _rows(cls: type, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        annotation = hints[f.name]
        dotted = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(annotation):
            # a section that says what it is for
            if f.metadata.get("help"):
                yield dotted, "section", "", "", f.metadata["help"]
            yield from _rows(annotation, dotted + ".")
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        meta = f.metadata
        limits = [
            f"{word} {meta[key]}"
            for key, word in (("ge", ">="), ("gt", ">"), ("le", "<="))
            if meta.get(key) is not None
        ]
        if meta.get("choices"):
            limits.append(" | ".join(map(str, meta["choices"])))
        type_name = annotation.__name__ if isinstance(annotation, type) else str(annotation)
        # a pipe would split the cell
        type_name = type_name.replace("typing.", "").replace(" | ", " or ")
        yield dotted, type_name, repr(default), ", ".join(limits), meta.get("help", "")


def _cell(text: str) -> str:
    """A table cell's text: a bare `|` would end the cell and shift the row's columns."""
    return text.replace("|", "\\|")


def render_reference() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Every key keel accepts, generated from `keel/config/` by",
        "`python -m keel.config.docs > docs/config.md`. Unknown keys are errors (KEEL-C001).",
    ]
    for title, schema in (
        ("`keel train` (RL)", KeelConfig),
        (
            "`keel train` with `objective: dpo | reward_model` (preference training)",
            PreferenceConfig,
        ),
        ("`keel sft`", SFTConfig),
    ):
        lines += [
            "",
            f"## {title}",
            "",
            "| key | type | default | allowed | meaning |",
            "| --- | --- | --- | --- | --- |",
        ]
        for key, type_name, default, allowed, help_text in _rows(schema):
            default = f"`{_cell(default)}`" if default else ""
            lines.append(
                f"| `{key}` | {type_name} | {default} | {_cell(allowed)} | {_cell(help_text)} |"
            )
    lines += verl_reference()
    return "\n".join(lines) + "\n"


def verl_reference() -> list[str]:
    """verl's keys that keel's schema does not have, by rule; and keel's deliberate defaults."""
    from keel.config.verl_rules import ACCEPT, DIFFERENT_DEFAULTS, REFUSE, RULES

    lines = [
        "",
        "## verl's keys",
        "",
        "Every key of verl's `ppo_trainer.yaml` is one of three things. **Honoured**: the "
        "tables above have",
        "it, with verl's meaning. **Accepted**: keel already does what it asks, or it does "
        "not apply; what keel",
        'does instead is below, and `keel check` lists it under "decided for you". '
        "**Refused**: the value",
        "asks for something keel does not do, KEEL-C015 with what to use instead; verl's "
        "default value is",
        "always accepted. verl's `${...}` references are resolved, `null` means keel's "
        "default, and every",
        "problem of a config is reported at once. The first rule that matches a key applies.",
        "",
        "| verl key | in keel | what keel does |",
        "| --- | --- | --- |",
    ]
    kinds = {ACCEPT: "accepted", REFUSE: "refused unless verl's default", "rename": "renamed"}
    for rule in RULES:
        what = f"`{rule.target}` ({rule.note})" if rule.target else rule.note
        lines.append(f"| `{rule.pattern}` | {kinds[rule.kind]} | {what.replace('|', '/')} |")
    lines += [
        "",
        "### Same name, checked against verl's arithmetic",
        "",
        "- `algorithm.critic_warmup` (verl: `trainer.critic_warmup`): counted as verl counts, the "
        "actor is updated from step N on.",
        "- GSPO reduces its loss by `loss_agg_mode`, as verl 0.9.1's `gspo` loss does (the "
        "paper's objective is `seq-mean-token-mean`, which verl's GSPO examples set; the default "
        "is `token-mean`).",
        "- `seq-mean-token-sum-norm` (Dr. GRPO): keel takes the paper's mean over sequences of "
        "each sequence's token sum / `data.max_response_length`. verl sums over the sequences of "
        "each micro-batch and averages over micro-batches, so its loss (and gradient) is keel's "
        "times the micro-batch's sequence count: the same direction, a scale that changes with "
        "`ppo_micro_batch_size_per_gpu`. `keel check` says so when the mode is used.",
        "- `token-mean`: keel divides by the whole mini-batch's token count, so micro-batch "
        "losses add up to it exactly; verl averages micro-batch means, the same when "
        "micro-batches hold equal token counts.",
        "",
        "### Defaults keel chose differently",
        "",
        "`keel check` shows each one a config leaves unset.",
        "",
        "| key | keel | verl | why |",
        "| --- | --- | --- | --- |",
    ]
    defaults = dict(_rows_by_key(KeelConfig))
    for key, (verl, why) in DIFFERENT_DEFAULTS.items():
        lines.append(f"| `{key}` | `{defaults[key]}` | `{verl!r}` | {_cell(why)} |")
    return lines


def _rows_by_key(schema):
    for key, _type, default, _allowed, _help in _rows(schema):
        yield key, default


if __name__ == "__main__":
    print(render_reference(), end="")
