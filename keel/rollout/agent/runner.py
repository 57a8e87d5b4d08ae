"""Running one turn's tool calls: in parallel across every sample of the batch (threads, since a
tool is ordinary blocking code), at most `max_parallel_calls` per sample and turn, each with a
timeout. Whatever a call does, raise, hang, return something that is not text or far too much, the
model gets text back and the counters say what happened; the rollout never fails on a tool."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from keel.rollout.agent.parse import ToolCall
from keel.rollout.agent.tools import Tool, ToolOutput

TRUNCATED = "...(truncated)"
UNKNOWN = "unknown_tool"


@dataclass
class ToolLimits:
    max_parallel_calls: int = 1
    timeout_s: float = 30.0
    max_response_chars: int = 256
    truncate_side: str = "middle"  # verl's tool_response_truncate_side: left | middle | right


class ToolRunner:
    def __init__(self, tools: list[Tool], limits: ToolLimits):
        self.tools = {t.name: t for t in tools}
        self.limits = limits
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="keel-tool")

    def run(self, calls: list[list[ToolCall]], tools_kwargs: list[dict]) -> list[list[ToolOutput]]:
        """Each sample's calls (past max_parallel_calls: dropped) -> each call's output, for every
        sample at once."""
        kept = [sample_calls[:self.limits.max_parallel_calls] for sample_calls in calls]

        async def everything():
            return await asyncio.gather(*[asyncio.gather(*[self._call(c, kwargs) for c in sample])
                                          for sample, kwargs in zip(kept, tools_kwargs)])

        return [list(outputs) for outputs in asyncio.run(everything())]

    def call_each(self, functions: list) -> list[tuple[object, str]]:
        """Each function in a thread, all at once, each within the timeout: (its result, "ok"), or
        (what went wrong, "error" | "timeout"). For code of the user's that the model's turns drive
        (an environment's step), which must not hang or end the rollout either."""
        async def everything():
            return await asyncio.gather(*[self._in_thread(f) for f in functions])

        return [(result, status) for result, status, _ in asyncio.run(everything())] if functions else []

    async def _call(self, call: ToolCall, tools_kwargs: dict) -> ToolOutput:
        tool = self.tools.get(call.name)
        if tool is None:
            # Counted under one name: the model's names are hostile and would make a metric each.
            return ToolOutput(f"Error: no tool named {call.name[:60]!r}; the tools are {sorted(self.tools)}",
                              name=UNKNOWN, status="unknown")
        kwargs = (tools_kwargs or {}).get(call.name, {}).get("execute_kwargs", {})
        result, status, seconds = await self._in_thread(functools.partial(tool.execute, call.arguments, **kwargs))
        if status == "ok":
            try:
                output = _as_output(result)
            except Exception as error:  # noqa: BLE001 - a tool's bad result is the model's feedback too
                output = ToolOutput(f"Error when executing tool: {type(error).__name__}: {str(error)[:200]}",
                                    status="error")
        elif status == "timeout":
            output = ToolOutput(f"Error: {call.name} {result}", status="timeout")
        else:
            output = ToolOutput(f"Error when executing tool: {result}", status="error")
        output.name, output.seconds = call.name, seconds
        if len(output.text) > self.limits.max_response_chars:
            output.truncated = True
            output.text = truncate(output.text, self.limits.max_response_chars, self.limits.truncate_side)
        return output

    async def _in_thread(self, function) -> tuple[object, str, float]:
        """function() on a worker thread within the timeout (an async function's coroutine runs on
        a loop of its own there) -> (its result, or what went wrong; "ok" | "timeout" | "error"; the
        seconds it ran, from when it started rather than when it was queued)."""
        seconds = [self.limits.timeout_s]

        def timed():
            start = time.perf_counter()
            try:
                result = function()
                return asyncio.run(result) if inspect.iscoroutine(result) else result
            finally:
                seconds[0] = time.perf_counter() - start

        try:
            result = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self._pool, timed),
                                            self.limits.timeout_s)
            return result, "ok", seconds[0]
        except asyncio.TimeoutError:
            return f"took longer than {self.limits.timeout_s:g} s", "timeout", seconds[0]
        except Exception as error:  # noqa: BLE001 - reported, never raised
            return f"{type(error).__name__}: {str(error)[:200]}", "error", seconds[0]


def _as_output(result) -> ToolOutput:
    """text, or (text, reward[, metrics]) as verl's tools return; anything else is a tool bug."""
    if isinstance(result, ToolOutput):
        return result
    parts = result if isinstance(result, tuple) else (result,)
    text = getattr(parts[0], "text", parts[0])  # verl's ToolResponse carries .text
    reward = float(parts[1]) if len(parts) > 1 else 0.0
    metrics = parts[2] if len(parts) > 2 and isinstance(parts[2], dict) else {}
    if not isinstance(text, str):
        text = json.dumps(text) if isinstance(text, (dict, list, int, float)) else str(text)
    if reward != reward or abs(reward) == float("inf"):
        raise ValueError(f"the tool's reward is {reward}")
    return ToolOutput(text, reward, dict(metrics))


def truncate(text: str, limit: int, side: str) -> str:
    """verl's tool_response_truncate_side: which end of an over-long output is kept."""
    if side == "left":  # keep the beginning
        return text[:limit] + TRUNCATED
    if side == "right":  # keep the end
        return TRUNCATED + text[-limit:]
    half = limit // 2
    return text[:half] + TRUNCATED + text[len(text) - half:]
