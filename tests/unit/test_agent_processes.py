"""Agents in processes of their own (rollout.agent.processes): they run outside the engine's
process, a prompt's group in one process, each sample reported as its agent returns; a process
that dies or cannot build its agent is said with a code, never a hang. And what the rollout keeps
of samples whose agents failed after their budget was spent."""

import os

import pytest

from keel.config.agent import AgentConfig
from keel.errors import AGENT_FUNCTION, KeelError
from keel.rollout.agent.external.agent_processes import AgentProcesses
from keel.rollout.agent.external.agents import Job

AGENTS = """
import os


async def where(client, row, extra_info):
    return {"reward": 1.0, "metrics": {"pid": float(os.getpid())}}


async def dies(client, row, extra_info):
    if row["prompt"] == "last":
        os._exit(3)
    return 1.0
"""


@pytest.fixture
def agents_file(tmp_path):
    (tmp_path / "agents.py").write_text(AGENTS)
    return tmp_path / "agents.py"


def run(section: AgentConfig, jobs: list[Job]):
    pool = AgentProcesses(section, 2)
    ended = []
    try:
        return pool.run(["http://127.0.0.1:9/v1"], "token", jobs, 8, 60.0, ended.append), ended
    finally:
        pool.close()


def test_agents_run_in_their_own_processes_a_group_in_one(agents_file):
    jobs = [Job(f"s{i}", {"prompt": str(i)}, {}, group=i // 4) for i in range(16)]
    outcomes, ended = run(AgentConfig(function=f"{agents_file}:where"), jobs)
    pids = [o.metrics["pid"] for o in outcomes]
    # both processes, neither the engine's
    assert os.getpid() not in pids and len(set(pids)) == 2
    for group in range(4):
        assert len({pids[i] for i in range(16) if jobs[i].group == group}) == 1
    assert sorted(ended) == sorted(job.name for job in jobs) and all(
        o.reward == 1.0 for o in outcomes
    )


def test_a_dead_agent_process_or_a_bad_agent_name_is_said(agents_file):
    jobs = [
        Job(f"s{i}", {"prompt": "last" if i == 5 else str(i)}, {}, group=i // 4) for i in range(8)
    ]
    with pytest.raises(KeelError) as died:
        run(AgentConfig(function=f"{agents_file}:dies"), jobs)
    assert died.value.code == AGENT_FUNCTION and "exited (code 3)" in str(died.value)
    with pytest.raises(KeelError) as missing:
        run(AgentConfig(function=f"{agents_file}:nowhere"), jobs)
    assert missing.value.code == AGENT_FUNCTION and "no attribute 'nowhere'" in str(missing.value)


def test_a_cut_sample_without_a_reward_is_dropped_where_no_reward_function_scores_it(tiny_assets):
    """A sample its budget stopped is kept when something scores it: an agent function's leaves it
    to the reward function; an environment's (scored_by_agent) has none, so it leaves the update."""
    from keel.data.prompts import collate_prompts
    from keel.models.load import load_tokenizer
    from keel.rollout.agent.external.agents import Outcome
    from keel.rollout.agent.external.rollout import traces_batch
    from keel.rollout.agent.external.trace import Trace
    from keel.types import PromptRecord

    tokenizer = load_tokenizer(tiny_assets["model"])
    records = [PromptRecord(i, [5, 6, 7], "p", "verifiers:x", None) for i in range(3)]
    prompts = collate_prompts(records, tokenizer.pad_token_id)
    traces = [Trace() for _ in records]
    for trace in traces:
        trace.record([5, 6, 7], [8, 9], [-0.5, -0.5], stopped=False)
        # its next request found the budget spent, then the agent failed
        trace.budget_spent = True
    outcomes = [
        Outcome(status="timeout"),
        Outcome(reward=0.5, status="error", error="late"),
        Outcome(status="error"),
    ]

    def dropped(scored_by_agent: bool) -> list:
        batch = traces_batch(prompts, traces, outcomes, tokenizer, scored_by_agent)
        return [r.extra_info.get("agent_dropped") for r in batch.records]

    # the reward function scores the two without a reward
    assert dropped(False) == [None, None, None]
    # the one with its reward stays
    assert dropped(True) == ["timeout", None, "error"]


@pytest.mark.parametrize(
    ("cores", "expected"), [(16, (8, 8)), (64, (8, 8)), (2, (1, 1)), (1, (1, 1)), (None, (1, 1))]
)
def test_process_counts_default_to_one_per_two_cores(monkeypatch, cores, expected):
    from keel.rollout.agent.external.rollout import _agent_processes, _endpoint_processes

    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    section = AgentConfig(function="agents:where")
    assert (_agent_processes(section), _endpoint_processes(section)) == expected


def test_agents_in_the_engines_process_keep_the_endpoint_there_too():
    from keel.rollout.agent.external.rollout import _agent_processes, _endpoint_processes

    in_process = AgentConfig(function="agents:where", processes=0)
    assert (_agent_processes(in_process), _endpoint_processes(in_process)) == (0, 0)
    chosen = AgentConfig(function="agents:where", processes=3, endpoint_processes=5)
    assert (_agent_processes(chosen), _endpoint_processes(chosen)) == (3, 5)
