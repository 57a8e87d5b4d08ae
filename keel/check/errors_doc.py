"""Render docs/errors.md from the catalogue: `python -m keel.check.errors_doc > docs/errors.md`."""

from keel.errors import CATALOGUE

AREAS = {
    "E": "environment",
    "C": "configuration",
    "M": "model and tokenizer",
    "D": "data",
    "R": "reward",
    "T": "training numerics",
    "P": "parallel and distributed",
}


def render_errors() -> str:
    lines = [
        "# Error codes",
        "",
        "Every error keel raises for something a user can fix. Each prints as `error[KEEL-...]`",
        "followed by a `fix:` line; `keel explain CODE` prints the entry below. Generated from",
        "`keel/errors/` by `python -m keel.check.errors_doc > docs/errors.md`.",
    ]
    for area, name in AREAS.items():
        entries = [e for e in CATALOGUE.values() if e.code[5] == area]
        if not entries:
            continue
        lines += ["", f"## {area}: {name}"]
        for e in entries:
            lines += ["", f"### {e.code}: {e.title}", "", f"- cause: {e.cause}", f"- fix: {e.fix}"]
            if e.keys:
                lines.append("- keys: " + ", ".join(f"`{k}`" for k in e.keys))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_errors(), end="")
