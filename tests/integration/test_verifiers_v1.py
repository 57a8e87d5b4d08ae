"""verifiers' v1 API (verifiers >= 0.4) through keel, on CPU: the example taskset package
(examples/agent/keel-count-v1) loads through verifiers' own loader and trains from the example's
config, token-exact through the token-level endpoint; an environment that raises, hangs or returns
a malformed Episode makes a sample that is not scored and says why, never a zero; a bad name or
config is KEEL-C024."""

import asyncio
import json
import math
from pathlib import Path

import pytest
import yaml

from keel.api import train
from keel.errors import AGENT_ENVIRONMENT, KeelError

pytest.importorskip("verifiers.v1")

EXAMPLES = Path(__file__).parents[2] / "examples" / "agent"

# A taskset whose reward does what its config says: the faults an environment's code can have.
FAULTY = """
import asyncio
import verifiers.v1 as vf
from keel_count_v1 import ChatHarness
from keel_count_v1.taskset import CountData


class FaultyTask(vf.Task[CountData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def judged(self, task, trace):
        fault = task.prompt
        if fault == "raise":
            raise RuntimeError("the judge fell over")
        if fault == "hang":
            await asyncio.sleep(3600)
        if fault == "nan":
            return float("nan")
        if fault == "text":
            return "high"
        if fault == "empty":
            # keyed scores, none of them: no reward recorded
            return {}
        return 1.0


class FaultyTaskset(vf.Taskset[FaultyTask, vf.TasksetConfig]):
    def load(self):
        for fault in ("raise", "hang", "nan", "text", "empty", "fine"):
            yield FaultyTask(CountData(prompt=fault), self.config.task)


__all__ = ["ChatHarness", "FaultyTaskset"]
"""

# An Env whose episodes are not Episodes.
BAD_EPISODE = """
import verifiers.v1 as vf
from keel_count_v1 import ChatHarness, CountTaskset


class DictEnv(vf.SingleAgentEnv):
    async def run_episode(self, task, ctx, **kwargs):
        return {"reward": 1.0}


__all__ = ["ChatHarness", "CountTaskset", "DictEnv"]
"""


@pytest.fixture
def packages(tmp_path, monkeypatch):
    # installed as verifiers' ecosystem installs them: importable by the taskset's id
    monkeypatch.syspath_prepend(str(EXAMPLES / "keel-count-v1"))
    (tmp_path / "keel_faulty_v1.py").write_text(FAULTY)
    (tmp_path / "keel_dict_env_v1.py").write_text(BAD_EPISODE)
    monkeypatch.syspath_prepend(str(tmp_path))


def run_metrics(cfg: dict) -> list[dict]:
    run_dir = train(cfg).run_dir
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def example_config(tiny_config: dict) -> dict:
    """examples/agent/verifiers_v1.yaml on the tests' tiny model, two steps."""
    example = yaml.safe_load((EXAMPLES / "verifiers_v1.yaml").read_text())
    agent = example["actor_rollout_ref"]["rollout"]["agent"]
    agent["environment_args"]["taskset"]["tasks"] = 8
    agent["environment_args"]["agent"]["harness"]["max_tokens"] = 8
    tiny_config["actor_rollout_ref"]["rollout"].update(agent=agent, name="native")
    tiny_config["data"]["max_response_length"] = 32
    del tiny_config["data"]["train_files"], tiny_config["data"]["val_files"]
    tiny_config["trainer"].update({"test_freq": -1, "val_before_train": False})
    tiny_config.pop("custom_reward_function", None)
    return tiny_config


def test_the_example_v1_package_trains_token_exact(tiny_config, packages):
    from keel.check.preflight import run_checks
    from keel.config.load import load_run

    cfg = example_config(tiny_config)
    (finding,) = [f for f in run_checks(*load_run(cfg)).findings if f.check == "agent"]
    # keel check says which API and version runs it, and through which endpoint
    assert finding.level == "pass" and "v1 API" in finding.message
    assert "/inference/v1/generate" in finding.message
    steps = run_metrics(cfg)
    assert len(steps) == 2
    for m in steps:
        # one token-level turn an episode, never re-tokenised
        assert m["agent/prefix_breaks"] == 0 and m["agent/requests_per_sample"] == 1
        assert m["agent/errors"] == 0 and m["agent/dropped"] == 0
        # the task's metric and reward reach keel's
        assert m["agent/metrics/reply_chars/mean"] > 0
        assert 0 <= m["critic/score/mean"] <= 1
        assert math.isfinite(m["actor/pg_loss"])


def run_samples(tiny_assets, environment_args: dict, name: str, timeout_s: float = 600):
    """Every task of verifiers:NAME as a sample through keel's endpoint -> their Outcomes."""
    import torch

    from keel.models.load import load_causal_lm, load_tokenizer
    from keel.rollout.agent.external.agents import Job, run_agents
    from keel.rollout.agent.external.openai_server import OpenAIEndpoint
    from keel.rollout.agent.external.verifiers_env import load_verifiers_agent
    from keel.rollout.native import NativeRolloutEngine
    from keel.rollout.service import EngineService
    from keel.types import SamplingParams

    tokenizer = load_tokenizer(tiny_assets["model"])
    model = load_causal_lm(tiny_assets["model"], torch.device("cpu"))
    engine = NativeRolloutEngine(model, tokenizer, 64, torch.float32)
    service = EngineService(
        engine, SamplingParams(temperature=1.0), sequences=16, max_len=128, turn_tokens=8
    )
    endpoint = OpenAIEndpoint(service, tokenizer, token="t")
    url = endpoint.serve()
    try:
        agent = load_verifiers_agent(name, environment_args)
        rows = agent.rows("train")
        jobs = [Job(f"{name}-{i}", row, row["extra_info"], i) for i, row in enumerate(rows)]
        outcomes = asyncio.run(
            run_agents(agent, url, "t", jobs, 8, timeout_s, on_ended=lambda name: None)
        )
        return rows, outcomes, endpoint.traces
    finally:
        service.close()
        endpoint.close()


@pytest.mark.parametrize("client", ["train", "eval"])
def test_faults_of_an_environment_are_samples_not_scored_never_zeros(tiny_assets, packages, client):
    args = {"client": client, "agent": {"harness": {"id": "keel-faulty-v1", "max_tokens": 4}}}
    rows, outcomes, traces = run_samples(tiny_assets, args, "keel-faulty-v1", timeout_s=20)
    by_fault = {row["prompt"][-1]["content"]: outcome for row, outcome in zip(rows, outcomes)}
    assert by_fault["fine"].status == "ok" and by_fault["fine"].reward == 1.0
    said = {
        "raise": ("error", "the judge fell over"),
        "nan": ("error", "nan"),
        "text": ("error", "high"),
        "empty": ("error", "recorded no reward"),
        # keel's agent.timeout_s: the sample's, never the step's
        "hang": ("timeout", None),
    }
    for fault, (status, message) in said.items():
        outcome = by_fault[fault]
        assert outcome.status == status and outcome.reward is None, (fault, outcome)
        assert message is None or message in outcome.error, (fault, outcome)
    # each sample's model call reached keel's engine under its own name
    assert len(traces) == 6 and all(t.prefix_breaks == 0 for t in traces.values())


def test_an_environment_whose_episode_is_malformed_is_not_scored(tiny_assets, packages):
    args = {"taskset": {"tasks": 2}, "agent": {"harness": {"id": "keel-count-v1"}}}
    _, outcomes, _ = run_samples(tiny_assets, args, "keel-dict-env-v1")
    assert [o.status for o in outcomes] == ["error", "error"]
    assert all("not an Episode" in o.error and o.reward is None for o in outcomes)


def test_a_multi_turn_episode_through_chat_continues_the_sampled_tokens(tiny_assets, packages):
    args = {
        "client": "eval",
        "taskset": {"tasks": 2},
        "agent": {"harness": {"id": "keel-count-v1", "turns": 2, "max_tokens": 4}},
    }
    _, outcomes, traces = run_samples(tiny_assets, args, "keel-count-v1")
    assert [o.status for o in outcomes] == ["ok", "ok"]
    # both turns one stretch: keel's chat continuation, never the answer encoded again
    assert [(t.requests, t.prefix_breaks) for t in traces.values()] == [(2, 0), (2, 0)]


def test_v1_loader_errors_name_the_cause(packages):
    from keel.rollout.agent.external.verifiers_env import load_verifiers_agent

    for name, args, said in [
        ("keel-no-such-taskset", {}, "not found"),
        ("keel-count-v1", {"taskset": {"tasks": "many"}}, "tasks"),
        ("keel-count-v1", {"client": "vllm"}, "environment_args.client='vllm'"),
        ("keel-count-v1", {"taskset": [1]}, "must be mappings"),
        ("keel-count-v1", {"renderer": {"name": "no-such"}}, "environment_args.renderer"),
    ]:
        with pytest.raises(KeelError) as refused:
            load_verifiers_agent(name, args)
        assert refused.value.code == AGENT_ENVIRONMENT and said in str(refused.value)
    # the fix
    assert len(load_verifiers_agent("keel-count-v1", {"taskset": {"tasks": 3}}).rows("train")) == 3
