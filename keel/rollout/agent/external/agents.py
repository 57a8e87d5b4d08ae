"""Running agents, one a sample: each within `timeout_s`, at most `at_once` at a time, each with an
OpenAI client (one shared connection pool; each sample's copy names it in a header) at keel's
endpoint; a prompt's group scored once all its samples ended (where the agent scores by group).
What an agent raises or how long it hangs is its sample's Outcome, never a lost step.

This module runs in the engine's process or in agent processes of their own (agent_processes.py),
so it imports neither torch nor the engine.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from keel.errors import AGENT_FUNCTION, KeelError
from keel.rollout.agent.external.library_env import load_environment_agent
from keel.rollout.agent.external.outcome import Outcome, load_attribute, outcome_of


@dataclass
class Job:
    """One sample for an agent: its name (the endpoint's key), the row and extra_info it is given,
    and its prompt's group."""

    name: str
    row: dict
    extra_info: dict
    group: int


class FunctionAgent:
    """A user's async function as the agent of each sample. Agents of environment libraries
    (library_env.py) have the same `run`; theirs returns what `score_group` scores once every
    sample of the prompt's group has ended (a rubric may rank a group's answers against each
    other)."""

    def __init__(self, function):
        self.function = function

    async def run(self, client, row: dict, extra_info: dict) -> Outcome:
        return outcome_of(await self.function(client, row, extra_info))


async def run_agents(
    agent, url: str, token: str, jobs: list[Job], at_once: int, timeout_s: float, on_ended
):
    """Every job's agent -> their Outcomes in order; `on_ended(name)` as each sample's agent returns
    (its KV row can go), before its group is scored."""
    import openai

    # openai 2 logs through httpx, openai 3 through httpx2
    for client_log in ("httpx", "httpx2"):
        # a line per request would bury the step's
        logging.getLogger(client_log).setLevel(logging.WARNING)

    limit = asyncio.Semaphore(at_once)
    # One client, one connection pool and TLS setup (50 ms each on CPU); each sample's copy names
    # it.
    shared = openai.AsyncOpenAI(
        base_url=url, api_key=token, max_retries=0, http_client=_http_client(openai)
    )
    # an Outcome, or what the agent's score_group is to score
    ended: list = [None] * len(jobs)
    left_in_group = Counter(job.group for job in jobs)

    async def one(i: int, job: Job) -> None:
        async with limit:
            client = shared.with_options(default_headers={"X-Keel-Sample": job.name})
            try:
                ended[i] = await _guarded(agent.run(client, job.row, job.extra_info), timeout_s)
            finally:
                on_ended(job.name)
        left_in_group[job.group] -= 1
        # after the slot is free: a group never waits on itself
        if not left_in_group[job.group]:
            members = [j for j, other in enumerate(jobs) if other.group == job.group]
            await _score_group(agent, members, ended, timeout_s)

    try:
        await asyncio.gather(*[one(i, job) for i, job in enumerate(jobs)])
        return ended
    finally:
        await shared.close()


def _http_client(openai):
    """openai's aiohttp transport where it is installed (openai[aiohttp]): with hundreds of requests
    in flight in one process it spends about half the CPU a request that httpx's connection pool
    does (which scans its connections on every request), and the agents' own Python is what bounds
    how soon a wave of turns reaches the engine. None: openai's default (httpx)."""
    try:
        return openai.DefaultAioHttpClient()
    # an openai without it, or aiohttp not installed
    except (AttributeError, RuntimeError):
        return None


async def _guarded(call, timeout_s: float):
    """The agent's call within its timeout; what it raises is its Outcome, never a lost step."""
    try:
        return await asyncio.wait_for(call, timeout_s)
    except asyncio.TimeoutError:
        return Outcome(status="timeout")
    except Exception as error:  # noqa: BLE001 - the agent is user code: counted, never a lost step
        return Outcome(status="error", error=f"{type(error).__name__}: {error}"[:500])


async def _score_group(agent, members: list[int], ended: list, timeout_s: float) -> None:
    ran = [i for i in members if not isinstance(ended[i], Outcome)]
    if not ran:
        return
    scored = await _guarded(agent.score_group([ended[i] for i in ran]), timeout_s)
    for i, outcome in zip(ran, scored if isinstance(scored, list) else [scored] * len(ran)):
        ended[i] = outcome


def build_agent(section):
    """The agent a rollout.agent section names: its environment's, or its function."""
    if section.environment:
        return load_environment_agent(section)
    return FunctionAgent(load_agent_function(section.function))


def load_agent_function(spec: str, directory: Path | None = None):
    """`module:function` or `file.py:function` (relative to `directory`, default the working
    directory) -> the async function, or KEEL-C023 saying why not."""
    try:
        function, reason = load_attribute(spec, directory), "it is not an async def"
    except ValueError as error:
        function, reason = None, str(error)
    if not inspect.iscoroutinefunction(function):
        raise KeelError(
            AGENT_FUNCTION, f"actor_rollout_ref.rollout.agent.function={spec!r}: {reason}"
        )
    return function
