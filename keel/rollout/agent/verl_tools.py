"""verl's own tool classes, run unchanged in keel's agent loop.

A `verl.tools.base_tool.BaseTool` subclass named in `tool_config_path` is built as verl builds it,
`cls(config=..., tool_schema=OpenAIFunctionToolSchema)`, and driven through its async lifecycle,
one instance per sample and tool (the runner's open / run / close):
`create(instance_id, **create_kwargs)` before the episode's first turn (returning the id, or
(id, ToolResponse) since verl 0.5), `execute(instance_id, parameters, **execute_kwargs)` on each
call, `calc_reward(instance_id, **calc_reward_kwargs)` and `release(instance_id, **release_kwargs)`
after the last turn; the kwargs come from the row's `extra_info.tools_kwargs.<tool>`, as verl's
data preprocessors write them. `create` also gets `create_kwargs=` itself when it takes **kwargs:
verl's agent loop (0.5 to 0.9.1) passes the dict under that name, its SGLang rollout unpacked it,
and tools read one form or the other.

Rewards, as verl takes them: verl's agent loop (experimental/agent_loop/tool_agent_loop.py) keeps
execute's step reward in the sample's `tool_rewards` and adds nothing to the score; the score is the
reward function's. verl's agent loop never calls `calc_reward`; its SGLang rollout called it after
the last turn and gave the results to the reward function as `extra_info["rollout_reward_scores"]`
(by tool name). keel does both: `extra_info.tool_rewards` holds the step rewards,
`extra_info.rollout_reward_scores[<tool>]` each tool's calc_reward, and neither is added to the
score, so a verl reward function scores exactly as in verl. The text the model reads is the
`ToolResponse`'s text (or the string a tool of verl 0.4 returns); images and video are dropped:
keel trains text models.

verl's function tools (`function_tool_path`, verl 0.9.1's `@function_tool`) are loaded by verl's
own loader and called as verl calls them: stateless, `tools_kwargs` ignored, the return read by
verl's `normalize_function_tool_return`.

When verl cannot be imported, a config naming its classes is KEEL-E012, never an ImportError.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

from keel.errors import TOOL_CONFIG, VERL_UNAVAILABLE, KeelError
from keel.rollout.agent.tool_types import Tool, ToolOutput, missing_config_fix

VERL_BASE_TOOL = ("verl.tools.base_tool", "BaseTool")
INSTALL = "pip install --no-deps 'verl==0.9.1' && pip install pydantic tensordict"


def is_verl_tool(cls: type) -> bool:
    """A subclass of verl's BaseTool (told by its class path, so verl is not imported to ask)."""
    return any(
        (base.__module__, base.__name__) == VERL_BASE_TOOL for base in getattr(cls, "__mro__", ())
    )


def verl_unavailable(error: BaseException, where: str, what: str) -> KeelError | None:
    """KEEL-E012 when `error` (raised importing `what`) is verl missing, or verl failing to import
    a package it needs; None when it is something else."""
    if not isinstance(error, ImportError):
        return None
    missing = getattr(error, "name", None) or ""
    if missing == "verl" or missing.startswith("verl."):
        return KeelError(
            VERL_UNAVAILABLE,
            f"{where}: {what} needs verl, which is not installed here ({error})",
            f"{INSTALL} (verl's tool and interaction modules, without its training stack)",
        )
    if not _raised_inside_verl(error.__traceback__):
        return None
    return KeelError(
        VERL_UNAVAILABLE,
        f"{where}: {what} needs verl, which is installed but cannot be imported: "
        f"{type(error).__name__}: {error}",
        f"pip install {missing}" if missing else INSTALL,
    )


def _raised_inside_verl(traceback: TracebackType | None) -> bool:
    spec = importlib.util.find_spec("verl") if "verl" not in sys.modules else None
    roots = [str(Path(p)) for p in (spec.submodule_search_locations or [])] if spec else []
    roots += [str(Path(p)) for p in getattr(sys.modules.get("verl"), "__path__", [])]
    while traceback is not None:
        if any(traceback.tb_frame.f_code.co_filename.startswith(root) for root in roots):
            return True
        traceback = traceback.tb_next
    return False


def _verl_module(name: str, where: str, what: str):
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise verl_unavailable(error, where, what) or KeelError(
            VERL_UNAVAILABLE,
            f"{where}: {what} needs {name}, which cannot be imported: {error}",
            INSTALL,
        ) from None


def build_verl_tool(cls: type, entry: dict, where: str) -> VerlTool:
    """verl's tool built as verl builds it: config and the tool_schema as verl's schema object."""
    schemas = _verl_module("verl.tools.schemas", where, entry["class_name"])
    config = dict(entry.get("config") or {})
    if config.get("type", "native") != "native":
        raise KeelError(
            TOOL_CONFIG,
            f"{where}: config.type is {config['type']!r}; verl 0.9.1 and keel run native "
            "tools only (verl removed its MCP tools)",
            f"set config.type: native in {where.split(' ')[0]}",
        )
    raw = entry.get("tool_schema")
    try:
        schema = None if raw is None else schemas.OpenAIFunctionToolSchema.model_validate(raw)
    except Exception as error:  # noqa: BLE001 - pydantic's ValidationError, named
        raise KeelError(
            TOOL_CONFIG,
            f"{where}: tool_schema is not verl's OpenAIFunctionToolSchema: "
            f"{str(error).splitlines()[0:3]}",
            "write it as verl's examples do: {type: function, "
            "function: {name, description, parameters: {type: object, properties, required}}}",
        ) from None
    try:
        tool = cls(config=config, tool_schema=schema)
    except Exception as error:  # noqa: BLE001 - the user's class: its error, named
        raise KeelError(
            TOOL_CONFIG,
            f"{where} ({entry['class_name']}) raised when built: {type(error).__name__}: {error}",
        ) from None
    return VerlTool(tool)


class VerlTool(Tool):
    """keel's side of one built verl BaseTool: every method is a coroutine the runner awaits on its
    shared loop, within the tool timeout."""

    lifecycle = True

    def __init__(self, tool):
        self.tool = tool
        self.config = tool.config
        # What verl's agent loop gives the chat template.
        self.schema = tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)

    async def create(self, instance_id: str, create_kwargs: dict) -> str:
        keywords = dict(create_kwargs)
        if _takes_var_keyword(self.tool.create) and "create_kwargs" not in keywords:
            keywords["create_kwargs"] = dict(create_kwargs)
        created = await _invoke(self.tool.create, instance_id, **keywords)
        # (id, ToolResponse)
        created = created[0] if isinstance(created, tuple) and created else created
        # a tool that keeps the id it was given and returns nothing
        if created is None:
            return instance_id
        if not isinstance(created, str):
            raise TypeError(f"create returned {type(created).__name__}, not an instance id")
        return created

    async def execute(self, parameters: dict, instance_id: str, **execute_kwargs) -> ToolOutput:
        result = await _invoke(self.tool.execute, instance_id, parameters, **execute_kwargs)
        parts = result if isinstance(result, tuple) else (result,)
        return ToolOutput(_text(parts[0]), metrics=_metrics(parts), step_reward=_reward(parts))

    async def calc_reward(self, instance_id: str, calc_reward_kwargs: dict) -> float:
        reward = await _invoke(self.tool.calc_reward, instance_id, **calc_reward_kwargs)
        return _finite(reward, "calc_reward")

    async def release(self, instance_id: str, release_kwargs: dict) -> None:
        await _invoke(self.tool.release, instance_id, **release_kwargs)


class VerlFunctionTool(Tool):
    """One of verl's function tools (its registry's carrier): stateless, called as verl calls it."""

    def __init__(self, carrier, normalize):
        self.carrier, self.normalize = carrier, normalize
        self.config = {}
        self.schema = carrier.tool_schema.model_dump(exclude_unset=True, exclude_none=True)

    async def execute(self, parameters: dict, **execute_kwargs) -> ToolOutput:
        # verl ignores tools_kwargs for function tools ("stateless by design"); so does keel.
        response, reward, metrics = self.normalize(await self.carrier.call(parameters))
        return ToolOutput(
            _text(response), metrics=dict(metrics), step_reward=_finite(reward, "the step reward")
        )


def load_function_tools(path: str | Path) -> list[Tool]:
    """The tools of `function_tool_path`, through verl's own loader (its registry and schemas)."""
    key = "actor_rollout_ref.rollout.multi_turn.function_tool_path"
    path = Path(path)
    if not path.is_file():
        raise KeelError(
            TOOL_CONFIG,
            f"{key}={str(path)!r} does not exist",
            missing_config_fix(
                str(path), key, "a Python file of functions decorated with verl's @function_tool"
            ),
        )
    module = _verl_module("verl.tools.function_tool", key, "function_tool_path")
    try:
        carriers = module.load_function_tools_from_path(str(path))
    except Exception as error:  # noqa: BLE001 - the user's file (or verl's schema inference): named
        raise verl_unavailable(error, key, str(path)) or KeelError(
            TOOL_CONFIG,
            f"{path} could not be loaded as verl's function tools: {type(error).__name__}: "
            f"{str(error)[:300]}",
            "give each @function_tool a type hint on every parameter and a Google-style "
            "docstring with an Args: block, and each tool its own name",
        ) from None
    if not carriers:
        raise KeelError(
            TOOL_CONFIG,
            f"{path} registers no function tools",
            "decorate its functions with verl's @function_tool (from verl.tools.function_tool "
            "import function_tool), or list keel @tool functions in tool_config_path",
        )
    return [
        VerlFunctionTool(carrier, module.normalize_function_tool_return) for carrier in carriers
    ]


async def _invoke(method, *args, **kwargs):
    """An async method awaited; a plain one on a thread, so a blocking one cannot stall the loop."""
    if inspect.iscoroutinefunction(method):
        return await method(*args, **kwargs)
    result = await asyncio.to_thread(method, *args, **kwargs)
    return await result if inspect.isawaitable(result) else result


def _takes_var_keyword(method) -> bool:
    try:
        return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return False


def _text(response: Any) -> str:
    """verl's ToolResponse's text ("" when it has none, as verl), or a plain string (verl 0.4's
    tools)."""
    if hasattr(response, "text") and not isinstance(response, str):
        return response.text or ""
    if isinstance(response, str):
        return response
    raise TypeError(f"execute returned {type(response).__name__}, not a ToolResponse or a string")


def _reward(parts: tuple) -> float | None:
    return None if len(parts) < 2 or parts[1] is None else _finite(parts[1], "the step reward")


def _metrics(parts: tuple) -> dict:
    return dict(parts[2]) if len(parts) > 2 and isinstance(parts[2], dict) else {}


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{what} is {value!r}, not a finite number")
    return float(value)
