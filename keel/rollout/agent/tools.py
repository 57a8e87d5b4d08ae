"""Tools the policy can call: a plain typed Python function (`@tool`, schema derived from its
signature), a class named in verl's tool config file (`tool_config_path`: keel's Tool, or verl's
own BaseTool subclasses, run through their lifecycle by verl_tools.py), verl's function tools
(`function_tool_path`), and keel's built-ins.

A tool's output is hostile input: whatever it returns, raises or takes too long to do becomes text
fed back to the model (and counted), never an exception out of the rollout.
"""

from __future__ import annotations

import ast
import importlib
import operator
from pathlib import Path
from typing import Any

from keel.errors import TOOL_CONFIG, KeelError
from keel.errors.fixes import closest

# FunctionTool, ToolOutput and tool re-exported: code that imports them from here keeps working.
from keel.rollout.agent.tool_types import (  # noqa: F401
    FunctionTool,
    Tool,
    ToolOutput,
    missing_config_fix,
    tool,
)
from keel.rollout.agent.verl_tools import (
    build_verl_tool,
    is_verl_tool,
    load_function_tools,
    verl_unavailable,
)

# --- built-ins
# -------------------------------------------------------------------------------------
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
MAX_EXPRESSION = 200
MAX_MAGNITUDE = 10**30


class Calculator(Tool):
    """Arithmetic on numbers (+ - * / // %, parentheses), parsed, never eval'd: an expression the
    model wrote cannot reach Python. Powers are left out, so no call can take unbounded time."""

    schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression, e.g. 123 * 456",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }

    def execute(self, parameters: dict, **tools_kwargs) -> str:
        expression = str(parameters.get("expression", ""))
        if len(expression) > MAX_EXPRESSION:
            raise ValueError(f"expression longer than {MAX_EXPRESSION} characters")
        value = _evaluate(ast.parse(expression, mode="eval").body)
        return str(int(value) if isinstance(value, float) and value.is_integer() else value)


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        value = _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        value = _OPERATORS[type(node.op)](_evaluate(node.operand))
    else:
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError("result too large")
    return value


class PythonCode(Tool):
    """The model's Python, run in keel's code sandbox (bubblewrap as an unprivileged user, seccomp,
    no network, a small scratch directory, CPU, memory, process and output limits:
    keel.rewards.jail.sandbox): what it prints, and the last lines of its error when it fails. The
    machine's jail is required as for code rewards (`isolation` by default): model-written code
    never runs unfenced."""

    schema = {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run a Python program and read what it prints",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string"}},
                "required": ["code"],
            },
        },
    }

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        from keel.rewards.jail.bwrap import Limits
        from keel.rewards.jail.sandbox import require_jail

        super().__init__(config, tool_schema)
        self.jail = require_jail(self.config.get("require", "isolation"))
        self.limits = Limits(
            cpu_s=int(self.config.get("cpu_s", 5)),
            wall_s=float(self.config.get("wall_s", 10)),
            memory_mb=int(self.config.get("memory_mb", 512)),
        )

    def execute(self, parameters: dict, **tools_kwargs) -> str:
        from keel.rewards.jail.bwrap import run_jailed
        from keel.rewards.jail.sandbox import limit_verdict

        finished = run_jailed(
            self.jail.mode,
            str(parameters.get("code", "")),
            "",
            self.limits,
            accounted=self.jail.protections["accounting"],
        )
        output = finished.stdout.decode(errors="replace")
        stopped = finished.stopped or limit_verdict(finished, self.limits)
        if stopped:
            return f"{output}\nError: the program was stopped: {stopped}"
        if finished.returncode != 0:
            error = finished.stderr.decode(errors="replace").strip().splitlines()[-3:]
            return f"{output}\nError (exit {finished.returncode}): " + "\n".join(error)
        return output


BUILTIN = {"keel.tools.Calculator": Calculator, "keel.tools.PythonCode": PythonCode}


# --- verl's tool config file
# --------------------------------------------------------------------------
def load_tool_config(path: str | Path) -> list[Tool]:
    """The tools of `tool_config_path`: verl's YAML (`tools: [{class_name, config, tool_schema}]`,
    a class one of keel's built-ins or `module.Class` importable here), or a Python file whose
    `@tool` functions and Tool instances are the tools. Anything that resolves to nothing is an
    error naming the entry, before any model loads."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise KeelError(
            TOOL_CONFIG,
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={str(path)!r} does not exist",
            missing_config_fix(
                str(path),
                "actor_rollout_ref.rollout.multi_turn.tool_config_path",
                "verl's tool config YAML, or a Python file of @tool functions",
            ),
        )
    tools = (
        _tools_of_file(path)
        if path.suffix == ".py"
        else _tools_of_yaml(path, yaml.safe_load(path.read_text()))
    )
    _check_names(tools, str(path))
    return tools


def load_tools(multi_turn) -> list[Tool]:
    """Every tool of a rollout.multi_turn section: tool_config_path's, then function_tool_path's
    (verl's function tools), each name once across both, as verl requires."""
    tools = load_tool_config(multi_turn.tool_config_path) if multi_turn.tool_config_path else []
    if getattr(multi_turn, "function_tool_path", None):
        tools += load_function_tools(multi_turn.function_tool_path)
        _check_names(tools, "tool_config_path and function_tool_path")
    return tools


def _check_names(tools: list[Tool], where: str) -> None:
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise KeelError(
            TOOL_CONFIG,
            f"{where}: two tools share a name in {names}",
            "give every tool its own name",
        )


def _load_file(path: Path):
    """A Python file of the user's as a module; its import error is a coded error naming it."""
    import importlib.util

    if not path.is_file():
        raise KeelError(TOOL_CONFIG, f"tool file {str(path)!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"keel_tools_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - the user's file: its error, named
        raise verl_unavailable(error, str(path), path.name) or KeelError(
            TOOL_CONFIG, f"{path} raised on import: {type(error).__name__}: {error}"
        ) from None
    return module


def _tools_of_file(path: Path) -> list[Tool]:
    tools = [value for value in vars(_load_file(path)).values() if isinstance(value, Tool)]
    if not tools:
        raise KeelError(
            TOOL_CONFIG,
            f"{path} defines no tools",
            "decorate a typed function with @keel.rollout.agent.tool, or make a Tool instance "
            "at module level",
        )
    return tools


def _tools_of_yaml(path: Path, loaded) -> list[Tool]:
    entries = (loaded or {}).get("tools") if isinstance(loaded, dict) else None
    if not isinstance(entries, list) or not entries:
        raise KeelError(
            TOOL_CONFIG, f"{path} has no `tools:` list", "list the tools as verl's tool config does"
        )
    return [
        _tool_from_entry(entry, f"{path} tools[{i}]", path.parent)
        for i, entry in enumerate(entries)
    ]


def _tool_from_entry(entry: Any, where: str, directory: Path) -> Tool:
    if not isinstance(entry, dict) or "class_name" not in entry:
        raise KeelError(TOOL_CONFIG, f"{where} has no class_name", "give each tool a class_name")
    cls = resolve_class(str(entry["class_name"]), where, directory)
    if is_verl_tool(cls):
        return build_verl_tool(cls, entry, where)
    schema = entry.get("tool_schema") or getattr(cls, "schema", None)
    if not schema or "name" not in schema.get("function", {}):
        raise KeelError(
            TOOL_CONFIG,
            f"{where} ({entry['class_name']}) has no tool_schema.function.name",
            "add the tool's OpenAI function schema under tool_schema",
        )
    return cls(entry.get("config") or {}, schema)


def resolve_class(class_name: str, where: str, directory: Path, method: str = "execute") -> type:
    """A built-in, `file.py:Class` (relative to `directory`), or an importable `module.Class`: a
    class with `method` (a tool's execute, an environment's step)."""
    cls, reason = _find_class(class_name, where, directory)
    if not (isinstance(cls, type) and callable(getattr(cls, method, None))):
        near = closest(class_name, BUILTIN) if method == "execute" else None
        fix = (
            f"write class_name: {near} in {where.split(' ')[0]} (the built-in tool spelt like it)"
            if near
            else f"use one of {sorted(BUILTIN)}, file.py:Class, or an importable module.Class with "
            f"a {method} method"
        )
        raise KeelError(
            TOOL_CONFIG,
            f"{where}: {class_name!r} names no class with the method {method}(): {reason}",
            fix,
        )
    return cls


def _find_class(class_name: str, where: str, directory: Path) -> tuple[object, str]:
    """(what the name resolves to, or None; why it might not be a class). A module that cannot be
    imported because verl cannot be is KEEL-E012."""
    if class_name in BUILTIN:
        return BUILTIN[class_name], "a built-in tool"
    if ".py:" in class_name:
        file, _, attr = class_name.partition(":")
        return getattr(_load_file(directory / file), attr, None), f"{file} has no class {attr!r}"
    module_name, _, attr = class_name.rpartition(".")
    if not module_name:
        return None, "not a module.Class path"
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        unavailable = verl_unavailable(error, where, class_name)
        if unavailable is not None:
            raise unavailable from None
        return None, f"module {module_name!r} cannot be imported ({error})"
    except Exception as error:  # noqa: BLE001 - the user's module raised while importing: named
        return None, f"module {module_name!r} raised on import: {type(error).__name__}: {error}"
    return getattr(module, attr, None), f"{module_name!r} has no class {attr!r}"
