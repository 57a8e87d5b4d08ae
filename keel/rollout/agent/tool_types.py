"""The types every tool shares: what a call gives back (ToolOutput), keel's Tool, a typed function
as a tool (`@tool`, its schema derived from its signature), and the fix a missing tool file's error
names. tools.py (keel's tools, verl's tool config) and verl_tools.py (verl's own classes) build on
them.
"""

from __future__ import annotations

import inspect
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from keel.errors import TOOL_CONFIG, KeelError
from keel.errors.fixes import nearby_file, setting

JSON_TYPES = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}


@dataclass
class ToolOutput:
    """What a call gave back: text for the model, a reward to add to the episode's score, metrics;
    and, filled in by the runner, how the call went."""

    text: str
    # added to the episode's score (keel's tools)
    reward: float = 0.0
    metrics: dict = field(default_factory=dict)
    # verl's tools' step reward: recorded (tool_rewards), not scored, as in verl
    step_reward: float | None = None
    name: str = ""
    # ok | error (raised, or bad output) | timeout | unknown (no such tool)
    status: str = "ok"
    seconds: float = 0.0
    truncated: bool = False


class Tool(ABC):
    """keel's tool: `execute(parameters, **execute_kwargs)` returns text, or (text, reward,
    metrics), plain or async. Subclasses set `schema` (an OpenAI function schema)."""

    # True: an instance per episode (create, calc_reward, release: verl_tools.VerlTool)
    lifecycle = False

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        self.config = config or {}
        self.schema = tool_schema or getattr(type(self), "schema", None)

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @abstractmethod
    def execute(self, parameters: dict, **tools_kwargs) -> str | tuple:
        """The call's text for the model, or (text, reward, metrics)."""


class FunctionTool(Tool):
    """A typed function as a tool: its name, docstring and parameters make the schema."""

    def __init__(self, fn: Callable, name: str | None = None):
        super().__init__(tool_schema=function_schema(fn, name))
        self.fn = fn
        self._accepts_extra = any(
            p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values()
        )

    def execute(self, parameters: dict, **tools_kwargs):
        return self.fn(**parameters, **(tools_kwargs if self._accepts_extra else {}))


def tool(fn: Callable | None = None, *, name: str | None = None):
    """`@tool` on a type-hinted function makes it a Tool the policy can call by its name."""
    if fn is None:
        return lambda f: FunctionTool(f, name)
    return FunctionTool(fn, name)


def function_schema(fn: Callable, name: str | None = None) -> dict:
    """The OpenAI function schema of a typed function: every named parameter must have a hint."""
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            continue
        hint = hints.get(param.name)
        if hint not in JSON_TYPES:
            raise KeelError(
                TOOL_CONFIG,
                f"tool {fn.__name__}: parameter {param.name!r} needs a type hint of "
                f"{', '.join(t.__name__ for t in JSON_TYPES)} (got {hint!r})",
                "annotate every parameter, e.g. def add(a: int, b: int) -> str",
            )
        properties[param.name] = {"type": JSON_TYPES[hint]}
        if param.default is param.empty:
            required.append(param.name)
    description = inspect.getdoc(fn) or ""
    return {
        "type": "function",
        "function": {
            "name": name or fn.__name__,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def missing_config_fix(missing: str, key: str, what: str) -> str:
    """A file there is, named like the missing one; else what the key takes."""
    found = nearby_file(missing, (".yaml", ".yml", ".py"))
    return (
        f"set {setting(key, found)} (the file there named most like it)"
        if found
        else f"point {key} at {what}"
    )
