"""OpenEnv environments trained unchanged through keel's OpenAI-compatible endpoint, end to end on
CPU, their servers built with OpenEnv's create_app and served by uvicorn in a thread: a text-action
environment reached through its own EnvClient subclass, and the examples' environment of MCP tools
reached through OpenEnv's MCPToolClient, each train for two steps through keel.train; keel check
says which OpenEnv is in use and what tools the environment offers. (`make test` runs this file
under .venv-openenv: OpenEnv 0.10 and verifiers 0.4 cannot share one environment.)"""

import math
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
from library_runs import library_config, run_metrics

from keel.errors import AGENT_ENVIRONMENT, KeelError

pytest.importorskip("openenv.core")

EXAMPLES = Path(__file__).parents[2] / "examples"


@contextmanager
def serving(app):
    """OpenEnv's app served by uvicorn in a thread -> its base URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        threading.Event().wait(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


OPENENV_ENV = (
    '''
from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.env_server.http_server import create_app


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    prompt: str = ""
    turn: int = 0


GUESSES = []  # every action's text, as the server received it


class GuessEnvironment(Environment):
    """Three guesses, 0.5 each."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id="e", step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(episode_id=episode_id or "e", step_count=0)
        return GuessObservation(prompt="Guess my word.", done=False, reward=0.0)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        done = self._state.step_count >= 3
        GUESSES.append(action.message)
        return GuessObservation(prompt="Not it. Again.", turn=self._state.step_count, '''
    """done=done, reward=0.5)

    @property
    def state(self):
        return self._state


class GuessEnv(EnvClient[GuessAction, GuessObservation, State]):
    def _step_payload(self, action):
        return {"message": action.message}

    def _parse_result(self, payload):
        observation = GuessObservation(**payload.get("observation", {}), """
    """done=payload.get("done", False))
        return StepResult(observation=observation, reward=payload.get("reward"), """
    """done=payload.get("done", False))

    def _parse_state(self, payload):
        return State(**payload)


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", """
    """max_concurrent_envs=64)
"""
)


@pytest.fixture
def openenv_server(tmp_path, monkeypatch):
    (tmp_path / "keel_guess_env.py").write_text(OPENENV_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    import keel_guess_env

    with serving(keel_guess_env.app) as url:
        yield url


def test_an_openenv_environment_trains_through_its_client(tiny_config, openenv_server):
    args = {"base_url": openenv_server, "max_tokens": 4}
    cfg = library_config(
        tiny_config, {"environment": "openenv:keel_guess_env:GuessEnv", "environment_args": args}
    )
    # three turns and the environment's two observations fit
    cfg["data"]["max_response_length"] = 256
    steps = run_metrics(cfg)
    assert len(steps) == 2
    # three guesses an episode, each a request; the sum of the step rewards is the reward
    for m in steps:
        assert m["agent/metrics/openenv_steps/mean"] == 3 and m["agent/requests_per_sample"] == 3
        assert m["agent/prefix_breaks"] == 0 and m["agent/dropped"] == 0
        # 0.5 a guess
        assert m["critic/score/mean"] == pytest.approx(1.5)
        assert math.isfinite(m["actor/pg_loss"])
    import keel_guess_env

    # the model's turns reached the environment as its actions
    assert len(keel_guess_env.GUESSES) == 2 * 16 * 3
    assert all(isinstance(guess, str) for guess in keel_guess_env.GUESSES)


def test_openenv_environment_errors_name_the_cause(openenv_server):
    from keel.rollout.agent.external.openenv_env import load_openenv_agent

    for name, args, said in [
        ("keel_guess_env:GuessEnv", {}, "base_url is not set"),
        (
            "keel_guess_env:GuessEnv",
            {"base_url": openenv_server, "url": 1},
            "unknown environment_args ['url']",
        ),
        (
            "keel_guess_env:GuessEnvironment",
            {"base_url": openenv_server},
            "not an openenv.core.EnvClient",
        ),
        (
            "keel_guess_env:GuessEnv",
            {"base_url": openenv_server, "action_field": "text"},
            "has no field 'text'",
        ),
        (
            "keel_guess_env:GuessEnv",
            {"base_url": openenv_server, "step_timeout_s": "soon"},
            "step_timeout_s='soon' is not a number > 0",
        ),
        (
            "keel_guess_env:GuessEnv",
            {"base_url": openenv_server, "max_tool_chars": 0},
            "max_tool_chars=0 is not a number > 0",
        ),
    ]:
        with pytest.raises(KeelError) as refused:
            load_openenv_agent(name, args)
        assert refused.value.code == AGENT_ENVIRONMENT and said in str(refused.value)
    # keel check's probe: nothing listens there
    with pytest.raises(KeelError) as unanswered:
        load_openenv_agent("keel_guess_env:GuessEnv", {"base_url": "http://127.0.0.1:9"}).probe(
            timeout_s=10
        )
    assert unanswered.value.code == AGENT_ENVIRONMENT and "did not answer a reset" in str(
        unanswered.value
    )
    fixed = load_openenv_agent("keel_guess_env:GuessEnv", {"base_url": openenv_server})
    fixed.probe()
    assert fixed.action_field == "message"


@pytest.fixture
def calculator_server(monkeypatch):
    """The examples' environment of MCP tools (examples/agent/keel_calculator_env.py)."""
    monkeypatch.syspath_prepend(str(EXAMPLES / "agent"))
    import keel_calculator_env

    with serving(keel_calculator_env.app) as url:
        yield url


def test_the_examples_mcp_environment_trains_with_its_tools_offered(tiny_config, calculator_server):
    from keel.check.preflight import run_checks
    from keel.config.load import load_config, load_run

    example = load_config(str(EXAMPLES / "agent" / "openenv.yaml")).actor_rollout_ref.rollout.agent
    args = {**example.environment_args, "base_url": calculator_server, "max_tokens": 8}
    agent = {"environment": example.environment, "environment_args": args}
    cfg = library_config(tiny_config, agent)
    # the tools' schemas are in every prompt
    cfg["data"]["max_response_length"] = 128
    (finding,) = [f for f in run_checks(*load_run(cfg)).findings if f.check == "agent"]
    # keel check: which OpenEnv, and what the environment offers
    assert finding.level == "pass" and "openenv 0.10" in finding.message
    assert "its MCP tools add, submit" in finding.message
    steps = run_metrics(cfg)
    assert len(steps) == 2
    for m in steps:
        assert m["agent/prefix_breaks"] == 0 and m["agent/dropped"] == 0
        assert m["agent/requests_per_sample"] >= 1
        assert "agent/metrics/openenv_steps/mean" in m
        assert math.isfinite(m["actor/pg_loss"])


def test_a_client_of_mcp_tools_takes_no_action_field(calculator_server):
    with pytest.raises(KeelError) as refused:
        from keel.rollout.agent.external.openenv_env import load_openenv_agent

        load_openenv_agent(
            "openenv.core:MCPToolClient", {"base_url": calculator_server, "action_field": "text"}
        )
    assert refused.value.code == AGENT_ENVIRONMENT
    assert "its actions are the model's tool calls" in str(refused.value)
