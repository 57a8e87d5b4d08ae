"""What a check reports: findings of a level, a failure carrying its catalogue code and fix."""

from __future__ import annotations

from dataclasses import dataclass

from keel.errors import KeelError

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"


class Skipped(Exception):
    """A check that needs what an earlier, failed check would have loaded."""


def need(context: dict, key: str):
    if key not in context:
        raise Skipped(key)
    return context[key]


@dataclass
class Finding:
    level: str
    check: str
    message: str
    code: str | None = None
    fix: str | None = None

    @classmethod
    def failed(cls, check: str, error: KeelError) -> Finding:
        return cls(FAIL, check, error.message, error.code, error.fix)

    def error(self) -> KeelError:
        return KeelError(self.code, self.message, self.fix)
