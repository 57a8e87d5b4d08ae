"""Running one turn's tool calls: in parallel across every sample of the batch (threads, since a
tool is ordinary blocking code), at most `max_parallel_calls` per sample and turn, each with a
timeout. Whatever a call does, raise, hang, return something that is not text or far too much, the
model gets text back and the counters say what happened; the rollout never fails on a tool.

Tools with a per-episode lifecycle (verl's BaseTool: verl_tools.py) get one instance per sample and
tool: `open` creates them before the episode's first turn, with the row's
`extra_info.tools_kwargs.<tool>.create_kwargs`; `close` asks each its `calc_reward` and releases
it, whatever happened before (a create that timed out is released too: it may have registered the
instance before it was cut). Each of these calls has the tool timeout and is counted when it fails.

Async code (an `async def` tool, verl's tools and interactions) runs on one event loop of its own
thread, as verl runs it on one loop: a tool's clients and locks belong to the loop they were made
on. An async tool that blocks that loop (a blocking call inside `async def`) stalls the others,
as in verl; each call is still cut at the timeout and counted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from uuid import uuid4

from keel.rollout.agent.parse import ToolCall
from keel.rollout.agent.tool_types import Tool, ToolOutput

TRUNCATED = "...(truncated)"
UNKNOWN = "unknown_tool"


@dataclass
class ToolLimits:
    max_parallel_calls: int = 1
    timeout_s: float = 30.0
    max_response_chars: int = 256
    # verl's tool_response_truncate_side: left | middle | right
    truncate_side: str = "middle"


@dataclass
class ToolSession:
    """One episode's side of its tools: the row's tools_kwargs, the instance of each lifecycle tool,
    and what those instances gave."""

    tools_kwargs: dict = field(default_factory=dict)
    # tool name -> instance id, created
    instances: dict[str, str] = field(default_factory=dict)
    # tool name -> instance id to release
    unreleased: dict[str, str] = field(default_factory=dict)
    # tool name -> why its create failed
    broken: dict[str, str] = field(default_factory=dict)
    # calc_reward by tool (verl's name)
    reward_scores: dict[str, float] = field(default_factory=dict)
    # execute's step rewards, in call order
    tool_rewards: list[float] = field(default_factory=list)
    # (tool, error | timeout) outside calls
    failures: list[tuple[str, str]] = field(default_factory=list)

    def kwargs(self, tool_name: str, key: str) -> dict:
        """verl's extra_info.tools_kwargs.<tool>.<create|execute|calc_reward|release>_kwargs."""
        entry = self.tools_kwargs.get(tool_name) if isinstance(self.tools_kwargs, dict) else None
        value = entry.get(key) if isinstance(entry, dict) else None
        return dict(value) if isinstance(value, dict) else {}


class ToolRunner:
    def __init__(self, tools: list[Tool], limits: ToolLimits):
        self.tools = {t.name: t for t in tools}
        self.limits = limits
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="keel-tool")

    def run(
        self, calls: list[list[ToolCall]], sessions: list[ToolSession | dict]
    ) -> list[list[ToolOutput]]:
        """Each sample's calls (past max_parallel_calls: dropped) -> each call's output, for every
        sample at once; `sessions`: each sample's (or its row's tools_kwargs)."""
        kept = [sample_calls[: self.limits.max_parallel_calls] for sample_calls in calls]
        sessions = [
            s if isinstance(s, ToolSession) else ToolSession(dict(s or {})) for s in sessions
        ]

        async def everything():
            return await asyncio.gather(
                *[
                    asyncio.gather(*[self._call(c, session) for c in sample])
                    for sample, session in zip(kept, sessions)
                ]
            )

        results = [list(outputs) for outputs in asyncio.run(everything())]
        # in call order, as verl keeps them
        for session, outputs in zip(sessions, results):
            session.tool_rewards += [o.step_reward for o in outputs if o.step_reward is not None]
        return results

    def call_each(self, functions: list) -> list[tuple[object, str]]:
        """Each function in a thread, all at once, each within the timeout: (its result, "ok"), or
        (what went wrong, "error" | "timeout"). For code of the user's that the model's turns drive
        (an environment's step), which must not hang or end the rollout either."""

        async def everything():
            return await asyncio.gather(*[self._in_thread(f) for f in functions])

        return (
            [(result, status) for result, status, _ in asyncio.run(everything())]
            if functions
            else []
        )

    def open(self, tools_kwargs: list[dict | None]) -> list[ToolSession]:
        """Each sample's session: an instance of every lifecycle tool, created with the row's
        create_kwargs (all samples' at once)."""
        sessions = [
            ToolSession(dict(kwargs) if isinstance(kwargs, dict) else {}) for kwargs in tools_kwargs
        ]
        jobs = [
            (session, tool, str(uuid4()))
            for session in sessions
            for tool in self.tools.values()
            if tool.lifecycle
        ]
        created = self.call_each(
            [
                functools.partial(
                    tool.create, instance_id, session.kwargs(tool.name, "create_kwargs")
                )
                for session, tool, instance_id in jobs
            ]
        )
        for (session, tool, instance_id), (result, status) in zip(jobs, created):
            if status == "ok":
                session.instances[tool.name] = session.unreleased[tool.name] = result
                continue
            session.broken[tool.name] = (
                f"its create {'took too long' if status == 'timeout' else result}"
            )
            session.failures.append((tool.name, status))
            # it may have registered the instance before it was cut
            if status == "timeout":
                session.unreleased[tool.name] = instance_id
        return sessions

    def close(self, sessions: list[ToolSession]) -> None:
        """Each created instance's calc_reward (verl's rollout_reward_scores), then every instance
        released, the failed ones too."""
        scoring = [
            (s, name, instance_id) for s in sessions for name, instance_id in s.instances.items()
        ]
        scores = self.call_each(
            [
                functools.partial(
                    self.tools[name].calc_reward, instance_id, s.kwargs(name, "calc_reward_kwargs")
                )
                for s, name, instance_id in scoring
            ]
        )
        for (session, name, _), (result, status) in zip(scoring, scores):
            if status == "ok":
                session.reward_scores[name] = result
            else:
                session.failures.append((name, status))
        releasing = [
            (s, name, instance_id) for s in sessions for name, instance_id in s.unreleased.items()
        ]
        released = self.call_each(
            [
                functools.partial(
                    self.tools[name].release, instance_id, s.kwargs(name, "release_kwargs")
                )
                for s, name, instance_id in releasing
            ]
        )
        for (session, name, _), (_, status) in zip(releasing, released):
            if status != "ok":
                session.failures.append((name, status))
        for session in sessions:
            session.unreleased.clear()

    async def _call(self, call: ToolCall, session: ToolSession) -> ToolOutput:
        tool = self.tools.get(call.name)
        if tool is None:
            # Counted under one name: the model's names are hostile and would make a metric each.
            return ToolOutput(
                f"Error: no tool named {call.name[:60]!r}; the tools are {sorted(self.tools)}",
                name=UNKNOWN,
                status="unknown",
            )
        if call.name in session.broken:
            return ToolOutput(
                f"Error: {call.name} could not start for this conversation "
                f"({session.broken[call.name]})",
                name=call.name,
                status="error",
            )
        kwargs = session.kwargs(call.name, "execute_kwargs")
        execute = (
            functools.partial(tool.execute, call.arguments, session.instances[call.name], **kwargs)
            if tool.lifecycle
            else functools.partial(tool.execute, call.arguments, **kwargs)
        )
        result, status, seconds = await self._in_thread(execute)
        if status == "ok":
            try:
                output = _as_output(result)
            # a tool's bad result is the model's feedback too
            except Exception as error:  # noqa: BLE001
                output = ToolOutput(
                    f"Error when executing tool: {type(error).__name__}: {str(error)[:200]}",
                    status="error",
                )
        elif status == "timeout":
            output = ToolOutput(f"Error: {call.name} {result}", status="timeout")
        else:
            output = ToolOutput(f"Error when executing tool: {result}", status="error")
        output.name, output.seconds = call.name, seconds
        if len(output.text) > self.limits.max_response_chars:
            output.truncated = True
            output.text = truncate(
                output.text, self.limits.max_response_chars, self.limits.truncate_side
            )
        return output

    async def _in_thread(self, function) -> tuple[object, str, float]:
        """function() on a worker thread within the timeout (an async function's coroutine runs on
        the shared loop, the thread waiting for it) -> (its result, or what went wrong; "ok" |
        "timeout" | "error"; the seconds it ran, from when it started rather than when it was
        queued)."""
        seconds = [self.limits.timeout_s]

        def timed():
            start = time.perf_counter()
            try:
                result = function()
                return (
                    on_shared_loop(result, self.limits.timeout_s)
                    if inspect.iscoroutine(result)
                    else result
                )
            finally:
                seconds[0] = time.perf_counter() - start

        try:
            result = await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(self._pool, timed), self.limits.timeout_s
            )
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
    # verl's ToolResponse carries .text
    text = getattr(parts[0], "text", parts[0])
    reward = float(parts[1]) if len(parts) > 1 else 0.0
    metrics = parts[2] if len(parts) > 2 and isinstance(parts[2], dict) else {}
    if not isinstance(text, str):
        text = json.dumps(text) if isinstance(text, (dict, list, int, float)) else str(text)
    if reward != reward or abs(reward) == float("inf"):
        raise ValueError(f"the tool's reward is {reward}")
    return ToolOutput(text, reward, dict(metrics))


class _SharedLoop:
    """The one event loop, on a thread of its own, that every async tool and interaction call runs
    on."""

    loop: asyncio.AbstractEventLoop | None = None
    lock = threading.Lock()

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls.lock:
            if cls.loop is None:
                cls.loop = asyncio.new_event_loop()
                threading.Thread(
                    target=cls.loop.run_forever, name="keel-async-tools", daemon=True
                ).start()
            return cls.loop


def on_shared_loop(coroutine, timeout_s: float | None = None):
    """The coroutine's result, run on the shared loop (from any thread but the loop's own); past
    `timeout_s` it is cancelled and TimeoutError raised."""
    future = asyncio.run_coroutine_threadsafe(coroutine, _SharedLoop.get())
    try:
        return future.result(timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise


def truncate(text: str, limit: int, side: str) -> str:
    """verl's tool_response_truncate_side: which end of an over-long output is kept."""
    # keep the beginning
    if side == "left":
        return text[:limit] + TRUNCATED
    # keep the end
    if side == "right":
        return TRUNCATED + text[-limit:]
    half = limit // 2
    return text[:half] + TRUNCATED + text[len(text) - half :]
