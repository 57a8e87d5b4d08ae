"""The mechanism of keel's error catalogue: a code's entry, the registry, and the exception that
carries a code."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Code:
    code: str
    title: str
    cause: str
    fix: str
    # config keys involved
    keys: tuple[str, ...] = field(default_factory=tuple)


CATALOGUE: dict[str, Code] = {}


def register(code: str, title: str, cause: str, fix: str, keys: tuple[str, ...] = ()) -> str:
    assert code not in CATALOGUE, f"duplicate code {code}"
    CATALOGUE[code] = Code(code, title, cause, fix, keys)
    return code


class KeelError(Exception):
    """An error the user can fix: it carries a catalogue code and a fix line."""

    def __init__(self, code: str, message: str, fix: str | None = None):
        assert code in CATALOGUE, f"unregistered error code {code}"
        self.code = code
        self.message = message
        self.fix = fix or CATALOGUE[code].fix
        super().__init__(f"{code}: {message}")

    # crosses process boundaries (Ray workers) with its code intact
    def __reduce__(self):
        return KeelError, (self.code, self.message, self.fix)

    def render(self) -> str:
        return f"error[{self.code}]: {self.message}\nfix: {self.fix}"


class SkipStep(Exception):
    """Raised instead of an error when `trainer.guards.nonfinite=skip`: the step is dropped,
    counted."""


def explain(code: str) -> str:
    entry = CATALOGUE[code]
    lines = [f"{entry.code}: {entry.title}", "", f"cause: {entry.cause}", f"fix:   {entry.fix}"]
    if entry.keys:
        lines.append("keys:  " + ", ".join(entry.keys))
    return "\n".join(lines)
