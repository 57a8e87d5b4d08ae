"""Agent code as the rollout, end to end on CPU: an async function written against the `openai`
client trains for two steps through keel.train, its reward reaches the metrics, and agents that
rewrite their history or raise are counted and left out of the update, never a lost step."""

import json
import math
import multiprocessing
from pathlib import Path

import pytest

from keel.api import train
from keel.errors import AGENT_FUNCTION, KeelError

pytest.importorskip("openai")

AGENT = (
    """
import itertools

calls = itertools.count()


async def agent(client, row, extra_info):
    n = next(calls)
    prompt = row["prompt"]
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
    messages += [first.choices[0].message.model_dump(exclude_none=True), """
    """{"role": "user", "content": "and?"}]
    if n % 4 == 1:  # this agent rewrites its history: its tokens must not be trained as sampled
        messages[0] = {"role": "user", "content": "something else entirely"}
    if n % 4 == 2:
        raise RuntimeError("the agent broke")
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
    return 0.25 * (n % 4)  # 0 or 0.75 for the samples that stay
"""
)


def agent_config(tiny_config, tmp_path: Path) -> dict:
    (tmp_path / "my_agent.py").write_text(AGENT)
    tiny_config["actor_rollout_ref"]["rollout"]["agent"] = {
        "function": str(tmp_path / "my_agent.py") + ":agent"
    }
    tiny_config["actor_rollout_ref"]["rollout"]["name"] = "native"
    tiny_config["data"]["max_response_length"] = 64
    tiny_config["trainer"].update({"test_freq": -1, "val_before_train": False})
    return tiny_config


def test_an_openai_client_agent_trains_and_its_failures_are_counted(tiny_config, tmp_path):
    from keel.check.preflight import run_checks
    from keel.config.load import load_run

    cfg = agent_config(tiny_config, tmp_path)
    (finding,) = [f for f in run_checks(*load_run(cfg)).findings if f.check == "agent"]
    assert finding.level == "pass" and "my_agent.py:agent" in finding.message
    run_dir = train(cfg).run_dir
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    # the endpoint's and the agents' processes ended with the run
    assert not [
        p.name
        for p in multiprocessing.active_children()
        if p.name.startswith(("keel-endpoint", "keel-agents"))
    ]
    # 4 prompts x 4 samples a step: a quarter rewrite their history, a quarter raise
    for m in steps:
        assert m["agent/prefix_breaks"] == 4 and m["agent/errors"] == 4 and m["agent/dropped"] == 8
        # the raising quarter asks once
        assert m["agent/requests_per_sample"] == pytest.approx(1.75)
        # the agent's rewards: 0 and 0.75, halves
        assert m["critic/score/mean"] == pytest.approx(0.375)
        assert math.isfinite(m["actor/pg_loss"])


def test_with_segments_a_rewritten_history_trains_instead_of_leaving_the_update(
    tiny_config, tmp_path
):
    cfg = agent_config(tiny_config, tmp_path)
    cfg["actor_rollout_ref"]["rollout"]["agent"].update(
        {"on_prefix_break": "segments", "processes": 0}
    )
    run_dir = train(cfg).run_dir
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    # the rewriting quarter stays (in two segments each); only the raising quarter leaves
    for m in steps:
        assert m["agent/prefix_breaks"] == 4 and m["agent/errors"] == 4 and m["agent/dropped"] == 4
        # a sample counts once
        assert m["critic/score/mean"] == pytest.approx((0 + 0.25 + 0.75) / 3)
        assert math.isfinite(m["actor/pg_loss"])


def test_an_agent_function_that_is_not_there_is_refused_by_name(tmp_path):
    from keel.rollout.agent.external.agents import load_agent_function

    (tmp_path / "agents.py").write_text("def agent(client, row, extra_info):\n    return 1.0\n")
    with pytest.raises(KeelError) as missing:
        load_agent_function("agents.py:agnet", tmp_path)
    assert missing.value.code == AGENT_FUNCTION and "no attribute 'agnet'" in str(missing.value)
    with pytest.raises(KeelError, match="not an async def"):
        load_agent_function("agents.py:agent", tmp_path)
    with pytest.raises(KeelError, match="could not be loaded"):
        load_agent_function("no_such_module_here:agent", tmp_path)
    (tmp_path / "agents.py").write_text(
        "async def agent(client, row, extra_info):\n    return 1.0\n"
    )
    # the fix: an async def
    assert load_agent_function("agents.py:agent", tmp_path).__name__ == "agent"


def test_the_examples_agent_config_names_an_agent_keel_can_load():
    from keel.config.load import load_config
    from keel.rollout.agent.external.agents import load_agent_function

    root = Path(__file__).parents[2]
    cfg = load_config(str(root / "examples" / "agent" / "grpo.yaml"))
    agent = cfg.actor_rollout_ref.rollout.agent
    assert cfg.actor_rollout_ref.rollout.name == "native" and agent.function.endswith(":agent")
    assert load_agent_function(agent.function, root).__name__ == "agent"
