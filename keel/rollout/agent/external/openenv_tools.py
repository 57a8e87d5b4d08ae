"""An OpenEnv environment's MCP tools (its client an `MCPClientBase`) as the policy's tools: what
its `ListToolsAction` lists become OpenAI tool schemas in each request to keel's endpoint, the
model's calls become `CallToolAction`s, and what each returns becomes a tool turn. What the
environment returns is untrusted: a malformed list of tools ends the sample as an error (never a
silent zero), a malformed or failed result is a tool turn that says so, and a result longer than
`max_tool_chars` is cut."""

from __future__ import annotations

import json
import math

# characters of one tool result the model is shown
MAX_TOOL_CHARS = 4096


class EnvironmentFault(Exception):
    """The environment answered, but not with what its API promises: the sample's error."""


def tool_schemas(observation) -> list[dict]:
    """A ListToolsObservation's tools as OpenAI tool schemas; EnvironmentFault when they are not
    tools."""
    tools = getattr(observation, "tools", None)
    if not isinstance(tools, list):
        raise EnvironmentFault(
            f"ListToolsAction answered {type(observation).__name__}, not a list of tools"
        )
    schemas = []
    for tool in tools:
        name, schema = getattr(tool, "name", None), getattr(tool, "input_schema", None)
        if not (isinstance(name, str) and name and isinstance(schema, dict)):
            raise EnvironmentFault(
                f"a listed tool is not a name and an input schema: {tool!r:.200}"
            )
        function = {"name": name, "description": str(getattr(tool, "description", "") or "")}
        schemas.append({"type": "function", "function": {**function, "parameters": schema}})
    return schemas


def call_arguments(call) -> dict | str:
    """A tool call's arguments as a dict, or the reason they are not one (said to the model)."""
    try:
        arguments = json.loads(call["function"].get("arguments") or "{}")
    except (json.JSONDecodeError, TypeError):
        return "error: the arguments are not JSON"
    return arguments if isinstance(arguments, dict) else "error: the arguments are not an object"


def tool_text(observation, max_chars: int) -> str:
    """A CallToolObservation as the tool turn's text: an error said as one, else the result's text
    content (its data, or the whole result as JSON, where it has no text); at most `max_chars`."""
    error = getattr(observation, "error", None)
    if error is not None:
        message = getattr(error, "message", error)
        return _capped(f"error: {message}", max_chars)
    if not hasattr(observation, "result"):
        return _capped(
            f"error: the environment answered {type(observation).__name__}, not a tool result",
            max_chars,
        )
    result = _as_dict(observation.result)
    text = _content_text(result)
    if text is None:
        data = result.get("data", result) if isinstance(result, dict) else result
        text = data if isinstance(data, str) else json.dumps(data, default=str)
    if isinstance(result, dict) and (result.get("is_error") or result.get("isError")):
        text = f"error: {text}"
    return _capped(text, max_chars)


def step_reward(reward) -> float:
    """A step's reward as a number: None (the step gave none) is 0; anything not a finite number is
    the environment's fault, never a silent 0."""
    if reward is None:
        return 0.0
    number = isinstance(reward, (int, float)) and not isinstance(reward, bool)
    if not (number and math.isfinite(reward)):
        raise EnvironmentFault(f"a step's reward is {reward!r:.80}, not a finite number")
    return float(reward)


def _as_dict(result):
    """FastMCP's CallToolResult (an object in process, a dict over the wire) as a dict."""
    if hasattr(result, "model_dump"):
        return result.model_dump()
    if hasattr(result, "__dataclass_fields__"):
        return {name: getattr(result, name) for name in result.__dataclass_fields__}
    return result


def _content_text(result) -> str | None:
    """The text parts of an MCP result's content, or None where it has none."""
    content = result.get("content") if isinstance(result, dict) else None
    if not isinstance(content, list):
        return None
    texts = [
        _as_dict(part).get("text")
        for part in content
        if isinstance(_as_dict(part), dict) and isinstance(_as_dict(part).get("text"), str)
    ]
    return "\n".join(texts) if texts else None


def _capped(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n[cut: {len(text) - max_chars} more characters]"
