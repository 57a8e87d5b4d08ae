"""Fix lines a user can apply as printed: config changes as backticked `key=value` overrides (what
`keel train CONFIG key=value ...` takes), paths that exist, directory names that are still free.

Raise sites compute them from the actual mistake. A fix line gives the option that works first; the
first backticked group of a fix line is that option, whole (tests/integration/test_fix_lines.py
applies it as printed).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

DATA_SUFFIXES = (".jsonl", ".parquet", ".json")
# Directories a command of the repository's quick-start fills (the README's first steps): the
# command, the file of this checkout it runs, and what it writes there. A file of these missing
# there is made by running the command.
MAKERS = {
    "examples/data": (
        "python examples/quickstart/prepare.py",
        "examples/quickstart/prepare.py",
        ("train.jsonl", "val.jsonl", "sft.jsonl", "model", "student"),
    ),
    # distill.yaml's teacher: the SFT run's output
    "checkpoints/quickstart": (
        "keel sft examples/quickstart/sft.yaml",
        "examples/quickstart/sft.yaml",
        ("sft_digits",),
    ),
}


def value_text(value: Any) -> str:
    """A value as an override writes it: YAML flow style without spaces (true, null, 0.003,
    [a,b])."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{value_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return repr(value)
    text = str(value)
    try:
        reads_back = yaml.safe_load(text) == value
    except yaml.YAMLError:
        reads_back = False
    plain = reads_back and not any(c.isspace() or c in "`'\",[]{}#" for c in text)
    return text if plain or isinstance(value, int) else "'" + text.replace("'", "''") + "'"


def overrides(settings: dict[str, Any]) -> str:
    """One option: every override it needs, in one backticked group."""
    return "`" + " ".join(f"{key}={value_text(value)}" for key, value in settings.items()) + "`"


def setting(key: str, value: Any) -> str:
    return overrides({key: value})


def shown(path: Path | str, like: str) -> str:
    """`path` as the user wrote its sibling `like`: relative to the working directory when that
    was."""
    path = Path(path)
    if Path(like).is_absolute():
        return str(path.absolute())
    try:
        return str(path.absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(path.absolute())


def nearby_file(missing: str, suffixes: Iterable[str] = DATA_SUFFIXES) -> str | None:
    """An existing file to give instead of `missing`, only when it plausibly is the one meant: in
    the same directory, a name a few letters off or the same stem with another suffix; else, under
    the nearest existing parent (three levels down at most), a file of the very same name."""
    wanted = Path(missing)
    folder = next((p for p in [wanted.parent, *wanted.parent.parents] if p.is_dir()), None)
    if folder is None:
        return None
    suffixes = tuple(s.lower() for s in suffixes)
    if folder == wanted.parent:
        scored = [
            (_likeness(wanted.name, p.name), p)
            for p in folder.iterdir()
            if p.is_file()
            and p.suffix.lower() in suffixes
            and (p.stem == wanted.stem or _likeness(wanted.name, p.name) >= 0.8)
        ]
    else:
        scored = [(1.0, p) for p in _files_below(folder, wanted.name, depth=3)]
    if not scored:
        return None
    best = max(scored, key=lambda item: (item[0], -len(str(item[1]))))[1]
    return shown(best, missing)


def nearby_model(missing: str, marker: str = "config.json") -> str | None:
    """A model directory (one holding config.json) to give instead of `missing`, only a plausible
    one: the only one below `missing` (a checkpoint's actor/), a sibling named a few letters off,
    or, under the nearest existing parent, one of the very same name."""
    wanted = Path(missing)
    if wanted.is_dir():
        found = [p.parent for p in [*wanted.glob(f"*/{marker}"), *wanted.glob(f"*/*/{marker}")]]
    else:
        folder = next((p for p in wanted.parents if p.is_dir()), Path("."))
        found = (
            [
                p
                for p in folder.iterdir()
                if (p / marker).is_file() and _likeness(p.name, wanted.name) >= 0.8
            ]
            if folder == wanted.parent
            else [
                p.parent
                for p in _files_below(folder, marker, depth=4)
                if p.parent.name == wanted.name
            ]
        )
    return shown(found[0], missing) if len(found) == 1 else None


def _likeness(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a.lower(), b.lower()).ratio()


def _files_below(folder: Path, name: str, depth: int, budget: int = 2000) -> list[Path]:
    """Files called `name` under `folder`, hidden folders skipped; at most `budget` entries read."""
    found, seen = [], 0
    for root, dirs, files in os.walk(folder):
        seen += len(dirs) + len(files)
        level = len(Path(root).relative_to(folder).parts)
        dirs[:] = (
            []
            if level >= depth or seen > budget
            else sorted(d for d in dirs if not d.startswith("."))
        )
        found += [Path(root) / name] if name in files else []
    return found


def maker_of(missing: str) -> str | None:
    """The command that makes `missing`, when it is a file a command of this checkout writes."""
    wanted = Path(missing).absolute()
    for folder, (command, source, names) in MAKERS.items():
        if (
            Path(source).is_file()
            and wanted.parent == Path(folder).absolute()
            and wanted.name in names
        ):
            return command
    return None


def writable_run_dir(run_dir: Path | str) -> str:
    """The fix for a run directory that cannot be written: one of the same name under the working
    directory, the home directory or the temporary one, whichever can be written."""
    import tempfile

    base = next(
        (
            b
            for b in (Path.cwd(), Path.home(), Path(tempfile.gettempdir()))
            if os.access(b, os.W_OK) and not (b / "checkpoints").is_file()
        ),
        Path(tempfile.gettempdir()),
    )
    new = free_directory(base / "checkpoints" / Path(run_dir).name)
    return (
        f"set {setting('trainer.default_local_dir', shown(new, 'relative'))} (a folder that can "
        "be written)"
    )


def free_directory(path: Path | str) -> Path:
    """`path` itself if nothing is there yet, else the first of `path_2`, `path_3`, ... that is
    free."""
    path = Path(path)
    number, candidate = 2, path
    while candidate.exists():
        candidate, number = path.with_name(f"{path.name}_{number}"), number + 1
    return candidate


def whole_batches(count: int, part_key: str, part: int) -> str | None:
    """A data.train_batch_size the `count` examples there are can fill, in whole parts (mini- or
    micro-batches of `part`); None when there is nothing to batch."""
    if count <= 0:
        return None
    if count >= part:
        return (
            f"set {setting('data.train_batch_size', count // part * part)} (the examples there "
            f"are, in whole batches of {part_key}={part})"
        )
    return (
        f"set {overrides({'data.train_batch_size': count, part_key: count})} (one batch of the "
        f"{count} there are)"
    )


def closest(wrong: str, choices: Iterable[str], cutoff: float = 0.75) -> str | None:
    """The choice `wrong` is a misspelling of (case, `-`/`_` and a letter or two off), or None: a
    near name that means something else is worse than no suggestion."""
    choices = [str(c) for c in choices]
    norm = {c.lower().replace("-", "_"): c for c in choices}
    key = str(wrong).lower().replace("-", "_")
    if key in norm:
        return norm[key]
    match = difflib.get_close_matches(key, list(norm), n=1, cutoff=cutoff)
    return norm[match[0]] if match else None
