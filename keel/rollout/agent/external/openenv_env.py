"""An OpenEnv environment (`openenv:module:ClientClass`, an `EnvClient` subclass, its server at
`environment_args.base_url`) as keel's rollout, through OpenEnv's async client. Each sample is one
episode on its own session: `reset`, then turn by turn the model's answer (through keel's endpoint)
is the action's text field and the observation's text field the next user message, until the
environment says done, the sample's token budget is spent or `max_turns` actions were taken (each
turn at most `max_tokens`). A client of MCP tools (an `MCPClientBase`, as `MCPToolClient`) offers
the tools its `ListToolsAction` lists to the model instead (openenv_tools.py): each call is a
`CallToolAction`, its result a tool turn, and a turn without calls ends the episode. The step
rewards summed are the sample's reward; `agent/metrics/openenv_steps/mean` counts the actions.

Faults end the sample as an error or a timeout (not scored, counted in agent/errors and
agent/timeouts), never as a silent zero: an environment that raises, does not answer within
`step_timeout_s`, answers what its API does not promise, or whose server goes away mid-episode."""

from __future__ import annotations

import asyncio
import json
import typing
from dataclasses import dataclass

from keel.rollout.agent.external.openai_requests import BUDGET_SPENT
from keel.rollout.agent.external.openenv_tools import (
    MAX_TOOL_CHARS,
    EnvironmentFault,
    call_arguments,
    step_reward,
    tool_schemas,
    tool_text,
)
from keel.rollout.agent.external.outcome import Outcome, environment_error, load_attribute

ARGS = (
    "base_url",
    "action_field",
    "observation_field",
    "max_turns",
    "max_tokens",
    "step_timeout_s",
    "max_tool_chars",
)
# what every OpenEnv observation has besides its own fields
BASE_FIELDS = ("done", "reward", "metadata")
# seconds a reset, step or tool call may take
STEP_TIMEOUT_S = 60.0


def openenv_core():
    """OpenEnv's core module and which API it is, by what is installed: `openenv.core` (openenv
    0.10, and openenv-core 0.3, which ships it too) or the older `openenv_core` alone."""
    try:
        import openenv.core as core

        return core, "openenv.core"
    except ImportError:
        pass
    try:
        import openenv_core as core
    except ImportError:
        return None, None
    return core, "openenv_core"


def openenv_version() -> str:
    """The installed OpenEnv distribution and version, as keel check says it."""
    from importlib import metadata

    core, api = openenv_core()
    for dist in ("openenv", "openenv-core"):
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        tools = "with MCP tools" if hasattr(core, "MCPClientBase") else "without MCP tools"
        return f"{dist} {version} (its {api} API, {tools})"
    return f"OpenEnv of unknown version (its {api} API)"


def load_openenv_agent(name: str, args: dict) -> OpenEnvAgent:
    spec = f"openenv:{name}"
    unknown = sorted(set(args) - set(ARGS))
    if unknown or not args.get("base_url"):
        reason = (
            f"unknown environment_args {unknown}"
            if unknown
            else "environment_args.base_url is not set"
        )
        raise environment_error(spec, f"{reason} (an OpenEnv environment takes {', '.join(ARGS)})")
    for key, kind in (("step_timeout_s", (int, float)), ("max_tool_chars", int)):
        value = args.get(key)
        if value is not None and not (
            isinstance(value, kind) and not isinstance(value, bool) and value > 0
        ):
            raise environment_error(spec, f"environment_args.{key}={value!r} is not a number > 0")
    core, _ = openenv_core()
    if core is None:
        raise environment_error(spec, "openenv is not installed (pip install 'keel[openenv]')")
    try:
        client_class = load_attribute(name)
    except ValueError as error:
        raise environment_error(spec, str(error)) from None
    if not (isinstance(client_class, type) and issubclass(client_class, core.EnvClient)):
        raise environment_error(spec, f"{name} is not an openenv.core.EnvClient subclass")
    mcp_base = getattr(core, "MCPClientBase", None)
    if mcp_base is not None and issubclass(client_class, mcp_base):
        if args.get("action_field"):
            raise environment_error(
                spec, f"{name} is a client of MCP tools: its actions are the model's tool calls"
            )
        return OpenEnvAgent(client_class, None, None, args, core)
    action_class = _action_class(client_class, spec)
    action_field = args.get("action_field") or _one_text_field(
        action_class, ("metadata",), spec, "action"
    )
    if action_field not in action_class.model_fields:
        raise environment_error(spec, f"{action_class.__name__} has no field {action_field!r}")
    return OpenEnvAgent(client_class, action_class, action_field, args, core)


@dataclass
class Episode:
    """What one episode has gathered: the step rewards summed, the actions, whether it is done."""

    reward: float = 0.0
    steps: int = 0
    done: bool = False
    # whether any step gave a reward (None is none)
    rewarded: bool = False

    def add(self, result) -> None:
        if not hasattr(result, "done"):
            raise EnvironmentFault(f"a step answered {type(result).__name__}, not a StepResult")
        self.reward += step_reward(result.reward)
        self.rewarded |= result.reward is not None
        self.steps, self.done = self.steps + 1, bool(result.done)


class OpenEnvAgent:
    def __init__(self, client_class, action_class, action_field: str | None, args: dict, core):
        self.client_class, self.action_class, self.action_field = (
            client_class,
            action_class,
            action_field,
        )
        self.core, self.tools_offered = core, action_class is None
        self.base_url, self.observation_field = args["base_url"], args.get("observation_field")
        self.max_turns, self.max_tokens = args.get("max_turns"), args.get("max_tokens")
        self.step_timeout_s = float(args.get("step_timeout_s") or STEP_TIMEOUT_S)
        self.max_tool_chars = int(args.get("max_tool_chars") or MAX_TOOL_CHARS)

    async def run(self, client, row: dict, extra_info: dict) -> Outcome:
        prompt = row["prompt"]
        messages = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        )
        episode = Episode()
        try:
            async with self.client_class(base_url=self.base_url) as env:
                result = await self._timed("reset", env.reset())
                episode.done = bool(getattr(result, "done", False))
                text = self._text(getattr(result, "observation", None))
                # an MCP environment's reset often has nothing to say
                if text and not (self.tools_offered and text == "{}"):
                    messages.append({"role": "user", "content": text})
                episode_of = self._tool_episode if self.tools_offered else self._text_episode
                await episode_of(env, client, messages, episode)
        except asyncio.TimeoutError as timeout:
            return Outcome(status="timeout", error=str(timeout) or "the environment timed out")
        # the environment's own exceptions, its faults, its server gone: the sample's error,
        # named with where in the episode it happened
        except Exception as error:  # noqa: BLE001
            said = f"{type(error).__name__}: {error}"
            return Outcome(
                status="error",
                error=f"the OpenEnv environment at {self.base_url} failed after "
                f"{episode.steps} steps: {said}"[:500],
            )
        metrics = {"openenv_steps": float(episode.steps)}
        if episode.steps and not episode.rewarded:
            # The environment stepped and never judged (every reward None): not a zero. With no
            # step the model ended the episode without acting, which earns nothing, as in
            # OpenEnv's own trainers: otherwise declining to act would never be learnt against.
            return Outcome(
                status="error",
                error=f"the OpenEnv environment at {self.base_url} gave no reward in "
                f"{episode.steps} step{'s' * (episode.steps != 1)}",
                metrics=metrics,
            )
        return Outcome(reward=episode.reward, metrics=metrics)

    async def _text_episode(self, env, client, messages: list[dict], episode: Episode) -> None:
        """The model's turns as the action's text field, the observations as user turns."""
        while not episode.done and (self.max_turns is None or episode.steps < self.max_turns):
            message = await self._turn(client, messages, None)
            # the sample's token budget is spent: its episode ends here
            if message is None:
                break
            text = message.get("content") or ""
            messages.append({"role": "assistant", "content": text})
            action = self.action_class(**{self.action_field: text})
            result = await self._timed("step", env.step(action))
            episode.add(result)
            messages.append({"role": "user", "content": self._text(result.observation)})

    async def _tool_episode(self, env, client, messages: list[dict], episode: Episode) -> None:
        """The environment's MCP tools offered to the model, its calls run as CallToolActions and
        their results its tool turns; a turn without calls is the model's last."""
        listed = await self._timed("ListToolsAction", env.step(self.core.ListToolsAction()))
        tools = tool_schemas(getattr(listed, "observation", None))
        names = [tool["function"]["name"] for tool in tools]
        turns = 0
        while not episode.done and (self.max_turns is None or turns < self.max_turns):
            message = await self._turn(client, messages, tools or None)
            if message is None:
                break
            messages.append(message)
            turns += 1
            calls = message.get("tool_calls") or []
            if not calls:
                break
            for call in calls:
                text = await self._call(env, call, names, episode)
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": text})
                if episode.done:
                    break

    async def _call(self, env, call: dict, names: list[str], episode: Episode) -> str:
        """One tool call run in the environment -> its tool turn's text."""
        name, arguments = call["function"]["name"], call_arguments(call)
        if name not in names:
            return f"error: there is no tool {name!r:.80}; the tools: {', '.join(names)}"
        if isinstance(arguments, str):
            return arguments
        action = self.core.CallToolAction(tool_name=name, arguments=arguments)
        result = await self._timed(f"call of the tool {name!r}", env.step(action))
        episode.add(result)
        return tool_text(result.observation, self.max_tool_chars)

    async def _timed(self, what: str, call):
        """The environment's answer within `step_timeout_s`, or asyncio.TimeoutError naming it."""
        try:
            return await asyncio.wait_for(call, self.step_timeout_s)
        except asyncio.TimeoutError:
            raise asyncio.TimeoutError(
                f"the OpenEnv environment at {self.base_url} did not answer a {what} within "
                f"{self.step_timeout_s:g} s (environment_args.step_timeout_s)"
            ) from None

    async def _turn(self, client, messages: list[dict], tools: list[dict] | None) -> dict | None:
        """The model's next turn as a message (its tool calls included), or None once the
        sample's token budget is spent."""
        import openai

        options = {"max_tokens": self.max_tokens} if self.max_tokens else {}
        if tools:
            options["tools"] = tools
        try:
            answer = await client.chat.completions.create(
                model="keel", messages=messages, **options
            )
        except openai.BadRequestError as error:
            if error.type == BUDGET_SPENT:
                return None
            raise
        return answer.choices[0].message.model_dump(exclude_none=True)

    def probe(self, timeout_s: float = 30.0) -> str:
        """One reset, its state (and its tools listed) on a session of its own (`keel check`) ->
        what it offers, said with the OpenEnv in use; KEEL-C024 when the server does not answer."""

        async def reset() -> list[str]:
            async with self.client_class(base_url=self.base_url) as env:
                await env.reset()
                await env.state()
                if not self.tools_offered:
                    return []
                listed = await env.step(self.core.ListToolsAction())
                return [t["function"]["name"] for t in tool_schemas(listed.observation)]

        try:
            names = asyncio.run(asyncio.wait_for(reset(), timeout_s))
        # refused, timed out, a server error or malformed tools: each named
        except Exception as error:  # noqa: BLE001
            reason = (
                f"its server at {self.base_url} did not answer a reset and its state"
                f"{' and ListToolsAction' if self.tools_offered else ''}: "
                f"{type(error).__name__}: {error}"
            )
            raise environment_error(f"openenv:{self.client_class.__name__}", reason) from None
        tools = f", its MCP tools {', '.join(names) or '(none)'}" if self.tools_offered else ""
        return f"{openenv_version()}{tools}"

    def _text(self, observation) -> str:
        """The observation as the next user message: its text field, or its own fields as JSON."""
        if not hasattr(observation, "model_dump"):
            raise EnvironmentFault(
                f"an observation is {type(observation).__name__}, not an OpenEnv Observation"
            )
        if self.observation_field:
            if not hasattr(observation, self.observation_field):
                raise EnvironmentFault(
                    f"an observation {type(observation).__name__} has no field "
                    f"{self.observation_field!r} (environment_args.observation_field)"
                )
            return str(getattr(observation, self.observation_field))
        own = observation.model_dump(exclude=set(BASE_FIELDS))
        texts = [value for value in own.values() if isinstance(value, str)]
        return texts[0] if len(texts) == 1 else json.dumps(own, default=str)


def _action_class(client_class, spec: str):
    """The Action class of EnvClient[Action, Observation, State] that the client class
    subclasses."""
    for klass in client_class.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type) and hasattr(args[0], "model_fields"):
                return args[0]
    raise environment_error(
        spec, f"{client_class.__name__} does not name its Action class (EnvClient[Action, ...])"
    )


def _one_text_field(model_class, skip: tuple[str, ...], spec: str, what: str) -> str:
    texts = [
        name
        for name, f in model_class.model_fields.items()
        if name not in skip and f.annotation is str
    ]
    if len(texts) != 1:
        raise environment_error(
            spec,
            f"its {what} {model_class.__name__} has {len(texts)} text fields {texts}: name the "
            f"one for the model's turn in environment_args.{what}_field",
        )
    return texts[0]
