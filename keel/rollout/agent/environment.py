"""Environments: tasks that answer the model's turns rather than its tool calls (a simulated user, a
game, a checker that gives feedback). keel's protocol, as in gym: one instance per episode, `reset`
before the first turn, `step(text)` after each assistant turn that calls no tool, returning the
observation (the next user turn), a reward added to the episode's score, and whether it is over;
`close` when the episode ends. verl's interaction classes run through this protocol too
(interaction.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path


class Environment(ABC):
    """Subclass and implement `step`; `config` is multi_turn.environment_config."""

    def __init__(self, config: dict | None = None):
        self.config = config or {}
        self.extra_info: dict = {}
        # the episode's prompt as in the data, set before reset
        self.prompt: str | list[dict] | None = None
        # its turns so far as messages, kept by the loop (read only)
        self.conversation: list[dict] = []

    def reset(self, extra_info: dict) -> None:
        """Before the episode's first turn: its data row's extra_info (the task's own settings,
        its answer), kept as self.extra_info for step."""
        self.extra_info = extra_info

    @abstractmethod
    def step(self, text: str) -> tuple[str, float, bool]:
        """The model's turn (its text) -> (observation for the next user turn, reward, done)."""

    # optional: a no-op unless the environment holds something
    def close(self) -> None:  # noqa: B027
        """After the episode's last turn: release what the episode held."""


def load_environment(class_name: str) -> type[Environment]:
    """`file.py:Class` or `module.Class` (from the working directory), a class with a step
    method."""
    from keel.rollout.agent.tools import resolve_class

    return resolve_class(
        class_name, "actor_rollout_ref.rollout.multi_turn.environment", Path.cwd(), method="step"
    )
