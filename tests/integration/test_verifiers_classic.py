"""verifiers' classic API (<= 0.3) trained unchanged through keel's OpenAI-compatible endpoint,
end to end on CPU: an environment package built with verifiers' own classes, loaded by
verifiers.load_environment, trains for two steps through keel.train, and its rewards and metrics
reach keel's metrics. verifiers 0.4 (v1, test_verifiers_v1.py) has no classic API and pins mcp 2,
so `make test` runs this file under .venv-openenv, beside OpenEnv's tests."""

import math
from pathlib import Path

import pytest
from library_runs import library_config, run_metrics

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


def test_where_verifiers_has_both_apis_each_package_runs_through_its_own(
    verifiers_package, monkeypatch
):
    """verifiers 0.3 has v1 beside its classic names: a package defining the classic
    load_environment goes to the classic loader, a v1 taskset package (the example's) to v1."""
    import importlib.util

    import verifiers

    from keel.rollout.agent.external.verifiers_env import classic_api

    assert importlib.util.find_spec("verifiers.v1") is not None, verifiers.__version__
    monkeypatch.syspath_prepend(
        str(Path(__file__).parents[2] / "examples" / "agent" / "keel-count-v1")
    )
    assert classic_api(verifiers, verifiers_package)
    assert not classic_api(verifiers, "keel-count-v1")
    # not importable: the classic loader names the cause, as before v1
    assert classic_api(verifiers, "no-such-environment")
