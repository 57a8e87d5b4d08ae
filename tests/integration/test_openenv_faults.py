"""An OpenEnv environment with MCP tools, run by keel's OpenEnv agent against its real server (a
process of its own, started as OpenEnv serves one: uvicorn over create_app), the model's turns
scripted: the tools reach the model as schemas, its calls run as CallToolActions and come back as
tool turns, and every fault of the environment is the sample's error or timeout, never a silent
zero: a tool that fails, returns too much or a reward that is no number, an environment that
raises, hangs, or whose server dies mid-episode."""

import asyncio
import json
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("openenv.core")

from keel.rollout.agent.external.openenv_env import load_openenv_agent  # noqa: E402

FAULTY_ENV = '''
import math, os, time

from fastmcp import FastMCP
from openenv.core import CallToolAction, MCPEnvironment, MCPToolClient, Observation, State
from openenv.core import create_app
from openenv.core.client_types import StepResult


class TaskObservation(Observation):
    task: str = ""


class FaultyEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        tools = FastMCP("faulty")

        @tools.tool
        def echo(text: str) -> str:
            """Says the text back."""
            return text

        @tools.tool
        def flood() -> str:
            """Too much output."""
            return "x" * 100000

        @tools.tool
        def fail() -> str:
            """Raises."""
            raise ValueError("the tool broke")

        @tools.tool
        def hang() -> str:
            """Never answers in time."""
            time.sleep(30)
            return "late"

        @tools.tool
        def die() -> str:
            """The server goes away."""
            os._exit(1)

        super().__init__(tools)
        self._state = State(episode_id="", step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        if os.environ.get("FAULTY_RESET"):
            raise RuntimeError("reset is broken")
        return TaskObservation(task="Use the tools.", done=False, reward=0.0)

    async def step_async(self, action, timeout_s=None, **kwargs):
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction):
            observation.reward = 0.25
        return observation

    def _step_impl(self, action, timeout_s=None, **kwargs):
        return Observation(done=False, reward=0.0)

    @property
    def state(self):
        return self._state


class WordRewardClient(MCPToolClient):
    """A client whose tool results carry a reward that is no number."""

    def _parse_result(self, payload):
        result = super()._parse_result(payload)
        if hasattr(result.observation, "tool_name"):
            return StepResult(observation=result.observation, reward="lots", done=False)
        return result


class NoRewardClient(MCPToolClient):
    """A client whose tool results never carry a reward: the environment never judges."""

    def _parse_result(self, payload):
        result = super()._parse_result(payload)
        if hasattr(result.observation, "tool_name"):
            return StepResult(observation=result.observation, reward=None, done=False)
        return result


class NoObservationClient(MCPToolClient):
    """A client whose results carry no observation."""

    def _parse_result(self, payload):
        return StepResult(observation=None, reward=0.0, done=False)


app = create_app(FaultyEnvironment, CallToolAction, TaskObservation, env_name="faulty",
                 max_concurrent_envs=8)
'''


@pytest.mark.parametrize(
    "client, said",
    [
        ("WordRewardClient", "a step's reward is 'lots', not a finite number"),
        ("NoObservationClient", "an observation is NoneType, not an OpenEnv Observation"),
        ("NoRewardClient", "gave no reward in 1 step"),
    ],
)
def test_malformed_results_end_the_sample_as_an_error(faulty_server, monkeypatch, client, said):
    _, url = faulty_server
    monkeypatch.syspath_prepend(str(url_folder[url]))
    outcome, _ = run_episode(
        url, [[("echo", '{"text": "hi"}')], "end"], f"keel_faulty_env:{client}"
    )
    assert outcome.status == "error" and outcome.reward is None and said in outcome.error


# each server's folder (its module there), by its url
url_folder = {}


def start_server(tmp_path, extra_env=None) -> tuple[subprocess.Popen, str]:
    """The environment's server in a process of its own -> (process, base_url) once it answers."""
    import os

    (tmp_path / "keel_faulty_env.py").write_text(FAULTY_ENV)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "keel_faulty_env:app", "--port", str(port)],
        cwd=tmp_path,
        env={**os.environ, **(extra_env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while process.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            url_folder[f"http://127.0.0.1:{port}"] = tmp_path
            return process, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    raise AssertionError("the environment's server did not start")


@pytest.fixture
def faulty_server(tmp_path):
    process, url = start_server(tmp_path)
    yield process, url
    process.kill()
    process.wait()


class ScriptedModel:
    """An OpenAI client whose chat turns are scripted: each turn calls the tools it names (with
    their arguments) or answers text; it records what each request offered and said."""

    def __init__(self, turns: list):
        self.turns, self.requests = list(turns), []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, model, messages, **options):
        self.requests.append({"messages": json.loads(json.dumps(messages)), **options})
        turn = self.turns.pop(0)
        if isinstance(turn, str):
            message = {"role": "assistant", "content": turn}
        else:
            calls = [
                {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
                for i, (name, arguments) in enumerate(turn)
            ]
            message = {"role": "assistant", "tool_calls": calls}
        reply = SimpleNamespace(model_dump=lambda **kwargs: message)
        return SimpleNamespace(choices=[SimpleNamespace(message=reply)])


def run_episode(url: str, turns: list, client="openenv.core:MCPToolClient", **args):
    agent = load_openenv_agent(client, {"base_url": url, **args})
    model = ScriptedModel(turns)
    row = {"prompt": [{"role": "user", "content": "Begin."}]}
    return asyncio.run(agent.run(model, row, {})), model


def tool_turns(model: ScriptedModel) -> list[str]:
    last = model.requests[-1]["messages"]
    return [m["content"] for m in last if m["role"] == "tool"]


def test_the_environments_tools_are_offered_called_and_answered_as_tool_turns(faulty_server):
    _, url = faulty_server
    turns = [
        [("echo", json.dumps({"text": "hello"})), ("flood", "{}")],
        [("fail", "{}"), ("no_such_tool", "{}"), ("echo", "not json")],
        "Done.",
    ]
    outcome, model = run_episode(url, turns, max_tool_chars=100)
    offered = {t["function"]["name"] for t in model.requests[0]["tools"]}
    assert offered == {"echo", "flood", "fail", "hang", "die"}
    assert model.requests[0]["messages"][1] == {"role": "user", "content": "Use the tools."}
    echoed, flooded, failed, unknown, malformed = tool_turns(model)
    assert echoed == "hello"
    # untrusted output: cut to max_tool_chars, and said so
    assert flooded.startswith("x" * 100) and "[cut: 99900 more characters]" in flooded
    assert failed.startswith("error:") and "the tool broke" in failed
    assert unknown.startswith("error: there is no tool 'no_such_tool'")
    assert malformed == "error: the arguments are not JSON"
    # three calls reached the environment, 0.25 each; the text turn ended the episode
    assert outcome.status == "ok" and outcome.reward == pytest.approx(0.75)
    assert outcome.metrics == {"openenv_steps": 3.0}


@pytest.mark.parametrize(
    "tool, status, said",
    [
        ("hang", "timeout", "did not answer a call of the tool 'hang' within 1 s"),
        ("die", "error", "failed after 0 steps"),
    ],
)
def test_faults_mid_episode_end_the_sample_as_an_error_never_a_zero(
    faulty_server, tool, status, said
):
    process, url = faulty_server
    outcome, _ = run_episode(url, [[(tool, "{}")], "never asked"], step_timeout_s=1)
    assert outcome.status == status and outcome.reward is None
    assert said in outcome.error
    if tool == "die":
        assert process.wait(timeout=30) == 1


def test_an_environment_that_raises_on_reset_is_the_samples_error(tmp_path):
    process, url = start_server(tmp_path, {"FAULTY_RESET": "1"})
    try:
        outcome, model = run_episode(url, ["never asked"])
    finally:
        process.kill()
        process.wait()
    assert (
        outcome.status == "error"
        and outcome.reward is None
        and "failed after 0 steps" in (outcome.error)
    )
    assert model.requests == []
