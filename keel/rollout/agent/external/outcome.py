"""How one sample's agent ended (Outcome), read from what the agent returned; the loader of a user's
`module:name` or `file.py:name`; and the error an environment library's adapter raises. The agents
(agents.py) and the environment libraries' adapters (library_env.py, verifiers_env.py,
openenv_env.py) share them.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path

from keel.errors import AGENT_ENVIRONMENT, KeelError


@dataclass
class Outcome:
    """How one sample's agent ended."""

    reward: float | None = None
    # ok | error | timeout
    status: str = "ok"
    error: str | None = None
    # the agent's or environment's own, averaged per step
    metrics: dict[str, float] = field(default_factory=dict)


def outcome_of(value) -> Outcome:
    """An agent's return value: a number (the reward), None (left to the reward function), or
    {"reward": number | None, "metrics": {name: number}}."""
    metrics = {}
    if isinstance(value, dict):
        metrics, value = value.get("metrics") or {}, value.get("reward")
        if not isinstance(metrics, dict) or not all(
            _finite(v) and isinstance(k, str) for k, v in metrics.items()
        ):
            return Outcome(
                status="error",
                error=f"the agent's metrics {metrics!r:.80} are not {{name: number}}",
            )
    if value is None:
        return Outcome(metrics=metrics)
    if not _finite(value):
        return Outcome(
            status="error", error=f"the agent returned {value!r:.80}, not a finite number or None"
        )
    return Outcome(reward=float(value), metrics={k: float(v) for k, v in metrics.items()})


def _finite(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def load_attribute(spec: str, directory: Path | None = None):
    """What `module:name` or `file.py:name` names (a file relative to `directory`, default the
    working directory); ValueError saying why there is none."""
    where, _, name = spec.rpartition(":")
    if not where:
        raise ValueError("not of the form module:name or file.py:name")
    try:
        if where.endswith(".py"):
            path = (directory or Path.cwd()) / where
            loader = importlib.util.spec_from_file_location(f"keel_agent_{path.stem}", path)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    # the user's module: missing or raising on import, named
    except Exception as error:  # noqa: BLE001
        raise ValueError(
            f"{where!r} could not be loaded: {type(error).__name__}: {error}"
        ) from None
    if not hasattr(module, name):
        raise ValueError(f"{where!r} has no attribute {name!r}")
    return getattr(module, name)


def environment_error(spec: str, reason: str) -> KeelError:
    return KeelError(
        AGENT_ENVIRONMENT, f"actor_rollout_ref.rollout.agent.environment={spec!r}: {reason}"
    )
