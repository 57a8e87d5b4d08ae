"""An OpenEnv environment (`openenv:module:ClientClass`, an `openenv.core.EnvClient` subclass, its
server at `environment_args.base_url`) as keel's rollout. Each sample is one episode on its own
session: `reset`, then turn by turn the model's answer (through keel's endpoint) is the action's
text field and the observation's text field the next user message, until the environment says done,
the sample's token budget is spent or `max_turns` actions were taken (each turn at most
`max_tokens`). The step rewards summed are the sample's reward; `agent/metrics/openenv_steps/mean`
counts the actions."""

from __future__ import annotations

import asyncio
import json
import typing

from keel.rollout.agent.external.openai_requests import BUDGET_SPENT
from keel.rollout.agent.external.outcome import Outcome, environment_error, load_attribute

ARGS = ("base_url", "action_field", "observation_field", "max_turns", "max_tokens")
# what every OpenEnv observation has besides its own fields
BASE_FIELDS = ("done", "reward", "metadata")


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
    try:
        from openenv.core import EnvClient
    except ImportError:
        raise environment_error(
            spec, "openenv-core is not installed (pip install 'keel[openenv]')"
        ) from None
    try:
        client_class = load_attribute(name)
    except ValueError as error:
        raise environment_error(spec, str(error)) from None
    if not (isinstance(client_class, type) and issubclass(client_class, EnvClient)):
        raise environment_error(spec, f"{name} is not an openenv.core.EnvClient subclass")
    action_class = _action_class(client_class, spec)
    action_field = args.get("action_field") or _one_text_field(
        action_class, ("metadata",), spec, "action"
    )
    if action_field not in action_class.model_fields:
        raise environment_error(spec, f"{action_class.__name__} has no field {action_field!r}")
    return OpenEnvAgent(client_class, action_class, action_field, args)


class OpenEnvAgent:
    def __init__(self, client_class, action_class, action_field: str, args: dict):
        self.client_class, self.action_class, self.action_field = (
            client_class,
            action_class,
            action_field,
        )
        self.base_url, self.observation_field = args["base_url"], args.get("observation_field")
        self.max_turns, self.max_tokens = args.get("max_turns"), args.get("max_tokens")

    async def run(self, client, row: dict, extra_info: dict) -> Outcome:
        prompt = row["prompt"]
        messages = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        )
        reward, steps = 0.0, 0
        async with self.client_class(base_url=self.base_url) as env:
            result = await env.reset()
            messages.append({"role": "user", "content": self._text(result.observation)})
            while not result.done and (self.max_turns is None or steps < self.max_turns):
                text = await self._turn(client, messages)
                # the sample's token budget is spent: its episode ends here
                if text is None:
                    break
                messages.append({"role": "assistant", "content": text})
                result = await env.step(self.action_class(**{self.action_field: text}))
                reward, steps = reward + float(result.reward or 0.0), steps + 1
                messages.append({"role": "user", "content": self._text(result.observation)})
        return Outcome(reward=reward, metrics={"openenv_steps": float(steps)})

    async def _turn(self, client, messages: list[dict]) -> str | None:
        import openai

        limit = {"max_tokens": self.max_tokens} if self.max_tokens else {}
        try:
            answer = await client.chat.completions.create(model="keel", messages=messages, **limit)
        except openai.BadRequestError as error:
            if error.type == BUDGET_SPENT:
                return None
            raise
        return answer.choices[0].message.content or ""

    def probe(self, timeout_s: float = 30.0) -> None:
        """One reset on a session of its own (`keel check`): KEEL-C024 when the server does not
        answer."""

        async def reset() -> None:
            async with self.client_class(base_url=self.base_url) as env:
                await env.reset()

        try:
            asyncio.run(asyncio.wait_for(reset(), timeout_s))
        # refused, timed out, or a server error: each named
        except Exception as error:  # noqa: BLE001
            reason = (
                f"its server at {self.base_url} did not answer a reset: {type(error).__name__}: "
                f"{error}"
            )
            raise environment_error(f"openenv:{self.client_class.__name__}", reason) from None

    def _text(self, observation) -> str:
        """The observation as the next user message: its text field, or its own fields as JSON."""
        if self.observation_field:
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
