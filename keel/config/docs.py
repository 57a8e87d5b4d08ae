"""Render the reference of every config key (docs/config.md): `python -m keel.config.docs`."""

from __future__ import annotations

import dataclasses
import typing

from keel.config.schema import KeelConfig
from keel.config.sft import SFTConfig


def _rows(cls: type, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        annotation = hints[f.name]
        dotted = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(annotation):
            if f.metadata.get("help"):  # a section that says what it is for
                yield dotted, "section", "", "", f.metadata["help"]
            yield from _rows(annotation, dotted + ".")
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        meta = f.metadata
        limits = [f"{word} {meta[key]}" for key, word in (("ge", ">="), ("gt", ">"), ("le", "<="))
                  if meta.get(key) is not None]
        if meta.get("choices"):
            limits.append(" \\| ".join(map(str, meta["choices"])))
        type_name = annotation.__name__ if isinstance(annotation, type) else str(annotation)
        type_name = type_name.replace("typing.", "").replace(" | ", " or ")  # a pipe would split the cell
        yield dotted, type_name, repr(default), ", ".join(limits), meta.get("help", "")


def render_reference() -> str:
    lines = ["# Configuration reference", "",
             "Every key keel accepts, generated from `keel/config/` by",
             "`python -m keel.config.docs > docs/config.md`. Unknown keys are errors (KEEL-C001)."]
    for title, schema in (("`keel train` (RL)", KeelConfig), ("`keel sft`", SFTConfig)):
        lines += ["", f"## {title}", "", "| key | type | default | allowed | meaning |", "| --- | --- | --- | --- | --- |"]
        for key, type_name, default, allowed, help_text in _rows(schema):
            default = f"`{default}`" if default else ""
            lines.append(f"| `{key}` | {type_name} | {default} | {allowed} | {help_text} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_reference(), end="")
