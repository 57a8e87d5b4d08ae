"""Environments of the environment libraries trained unchanged through keel's OpenAI-compatible
endpoint, end to end on CPU: a verifiers environment (a package built with verifiers' own classes,
loaded by verifiers.load_environment) and an OpenEnv environment (its server built with OpenEnv's
create_app, reached through its own EnvClient subclass) each train for two steps through keel.train,
and their rewards and metrics reach keel's metrics."""

import json
import math
import threading
from pathlib import Path

import pytest

from keel.api import train
from keel.errors import AGENT_ENVIRONMENT, KeelError

VERIFIERS_ENV = (
    '''
import verifiers as vf
from datasets import Dataset


class AskTwice(vf.MultiTurnEnv):
    """The user asks again after the model's first answer: two model turns an episode."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content="Say it once more.")]


def turns_answered(state, **kwargs) -> float:
    return len(state["trajectory"]) / 2


def group_size(states) -> list:  # a group-level function: '''
    """verifiers scores a prompt's samples together
    return [float(len(states))] * len(states)


def load_environment(questions: int = 8):
    dataset = Dataset.from_list([{"question": f"Count to {i}.", "answer": str(i)} """
    """for i in range(questions)])
    rubric = vf.Rubric(funcs=[turns_answered, group_size], weights=[1.0, 0.0])
    return AskTwice(dataset=dataset, rubric=rubric, max_turns=2, sampling_args={"max_tokens": 4})
"""
)


def classic_verifiers():
    """verifiers' classic API (<= 0.3); verifiers >= 0.4 has only v1 (test_verifiers_v1.py), and
    one environment holds one verifiers."""
    verifiers = pytest.importorskip("verifiers")
    if not hasattr(verifiers, "load_environment"):
        pytest.skip(f"verifiers {verifiers.__version__} has no classic API: test_verifiers_v1.py")


def run_metrics(cfg: dict) -> list[dict]:
    run_dir = train(cfg).run_dir
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def library_config(tiny_config: dict, agent: dict) -> dict:
    tiny_config["actor_rollout_ref"]["rollout"]["agent"] = agent
    tiny_config["actor_rollout_ref"]["rollout"]["name"] = "native"
    tiny_config["data"]["max_response_length"] = 64
    tiny_config["trainer"].update({"test_freq": -1, "val_before_train": False})
    # the environment's rewards are the run's
    tiny_config.pop("custom_reward_function", None)
    return tiny_config


@pytest.fixture
def verifiers_package(tmp_path, monkeypatch):
    classic_verifiers()
    (tmp_path / "keel_ask_twice.py").write_text(VERIFIERS_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    # verifiers' environment id: the module's name with dashes
    return "keel-ask-twice"


def test_a_verifiers_environment_trains_on_its_own_dataset_and_rubric(
    tiny_config, verifiers_package
):
    from keel.check.preflight import run_checks
    from keel.config.load import load_run

    cfg = library_config(tiny_config, {"environment": f"verifiers:{verifiers_package}"})
    # the environment's dataset is the prompts
    del cfg["data"]["train_files"], cfg["data"]["val_files"]
    (finding,) = [f for f in run_checks(*load_run(cfg)).findings if f.check == "agent"]
    assert finding.level == "pass" and verifiers_package in finding.message
    # which of verifiers' APIs runs it
    assert "classic API" in finding.message
    steps = run_metrics(cfg)
    assert len(steps) == 2
    # 4 prompts x 4 samples, each episode two turns
    for m in steps:
        assert m["agent/prefix_breaks"] == 0 and m["agent/requests_per_sample"] > 1.5
        # verifiers' own errors (an empty answer is one) end a rollout: counted, and out of the
        # update
        assert m["agent/dropped"] == m["agent/errors"] < 16
        assert m["agent/metrics/turns_answered/mean"] == 1.0
        # scored a group at once, all 4 samples in it
        assert m["agent/metrics/group_size/mean"] == 4.0
        # the rubric's weighted sum, its reward
        assert m["critic/score/mean"] == pytest.approx(1.0)
        assert math.isfinite(m["actor/pg_loss"])


def test_verifiers_environment_errors_name_the_cause(tiny_config, verifiers_package):
    from keel.config.load import load_config
    from keel.rollout.agent.external.library_env import load_environment_agent

    def agent_of(environment: str, args: dict | None = None):
        cfg = library_config(
            tiny_config, {"environment": environment, "environment_args": args or {}}
        )
        return load_environment_agent(load_config(cfg).actor_rollout_ref.rollout.agent)

    for environment, args, said in [
        ("verifiers:keel-no-such-env", None, "load_environment raised"),
        (f"verifiers:{verifiers_package}", {"questions": "many"}, "load_environment raised"),
        ("gym:CartPole", None, "not of the form"),
    ]:
        with pytest.raises(KeelError) as refused:
            agent_of(environment, args)
        assert refused.value.code == AGENT_ENVIRONMENT and said in str(refused.value)
    # the fix
    assert (
        agent_of(f"verifiers:{verifiers_package}", {"questions": 5}).env.get_dataset().num_rows == 5
    )


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
    pytest.importorskip("openenv.core")
    import uvicorn

    (tmp_path / "keel_guess_env.py").write_text(OPENENV_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    import keel_guess_env

    server = uvicorn.Server(
        uvicorn.Config(keel_guess_env.app, host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        threading.Event().wait(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=60)


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


def test_the_examples_verifiers_environment_loads_with_its_dataset(monkeypatch):
    classic_verifiers()
    from keel.config.load import load_config
    from keel.rollout.agent.external.library_env import environment_rows, load_environment_agent

    examples = Path(__file__).parents[2] / "examples"
    monkeypatch.syspath_prepend(str(examples / "agent"))
    cfg = load_config(str(examples / "agent" / "verifiers.yaml"))
    agent = cfg.actor_rollout_ref.rollout.agent
    assert load_environment_agent(agent).env.rubric is not None
    train, val = environment_rows(agent, "train"), environment_rows(agent, "val")
    assert (len(train), len(val)) == (240, 16) and train[0]["extra_info"]["verifiers"][
        "answer"
    ].isdigit()
