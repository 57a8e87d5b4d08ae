"""verl's own gsm8k tool and gsm8k interaction train two steps on CPU through keel, unchanged:
verl's tool and interaction config YAMLs (tests/data/verl_multi_turn), verl's classes (verl 0.9.1's
BaseTool and schemas; the gsm8k tool and interactions of verl 0.5.0, which 0.9.1 no longer ships,
from tests/data/verl_0_5_0 through tests/verl_shim.py), and rows as verl's data preprocessors write
them. The policy's turns are scripted (conftest.ScriptedEngine), the tiny model trained on them;
spies on verl's classes record every create, execute, release, start and finalize they see."""

import json
import sys
from pathlib import Path

import pytest

from keel.api import train
from keel.check.preflight import run_checks
from keel.config.load import load_run
from keel.errors import VERL_UNAVAILABLE, KeelError

from conftest import ScriptedEngine, write_jsonl
from verl_shim import install_verl_0_5_0_files

CONFIGS = Path(__file__).parents[1] / "data" / "verl_multi_turn"
SYSTEM_TOOL = (
    "You are a math expert. You are given a question and you need to solve it step by step. "
    "Reasoning step by step before any tool call. You should use the `calc_gsm8k_reward` tool "
    "after step by step solving the question, before generate final answer at least once and "
    "refine your answer if necessary. Put your final answer in the format of `#### <answer>`."
)
SYSTEM_INTERACTION = (
    "You are a math expert. You are given a question and you need to solve it step by step. You "
    "should rethinking carefully if user point out your answer is wrong. Put your final answer in "
    "the format of `#### <answer>`."
)
TOOL_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # a reward function of verl's SGLang rollout: the tool's calc_reward, where verl gave it
    return extra_info["rollout_reward_scores"].get("calc_gsm8k_reward", 0.0)
"""
INTERACTION_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(extra_info["rollout_reward_scores"].get("user_turn_rewards", []))
"""


def solution(index: int) -> str:
    return str(3 * index + 1)


def gsm8k_row(index: int, interaction: bool) -> dict:
    """As verl's examples/data_preprocess/gsm8k_multiturn_w_tool.py (or _w_interaction.py) writes
    it."""
    question = f"Question {index}: what is 3 times {index} plus 1?"
    prompt = question + " Let's think step by step and output the final answer after `####`."
    extra_info = {
        "split": "train",
        "index": index,
        "answer": f"#### {solution(index)}",
        "question": question,
    }
    if interaction:
        extra_info["interaction_kwargs"] = {
            "name": "gsm8k",
            "query": prompt,
            "ground_truth": solution(index),
        }
    else:
        extra_info.update(
            {
                "need_tools_kwargs": True,
                "tools_kwargs": {
                    "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": solution(index)}}
                },
                "interaction_kwargs": {"query": prompt, "ground_truth": solution(index)},
            }
        )
    return {
        "data_source": "openai/gsm8k",
        "ability": "math",
        "prompt": [
            {"role": "system", "content": SYSTEM_INTERACTION if interaction else SYSTEM_TOOL},
            {"role": "user", "content": prompt},
        ],
        "reward_model": {"style": "rule", "ground_truth": solution(index)},
        "extra_info": extra_info,
    }


def verl_config(tiny_config, tmp_path: Path, interaction: bool, reward: str) -> dict:
    rows = write_jsonl(tmp_path / "gsm8k.jsonl", [gsm8k_row(i, interaction) for i in range(8)])
    (tmp_path / "reward.py").write_text(reward)
    multi_turn = {"enable": True, "max_assistant_turns": 3, "format": "hermes"}
    multi_turn.update(
        {"interaction_config_path": str(CONFIGS / "gsm8k_interaction_config.yaml")}
        if interaction
        else {"tool_config_path": str(CONFIGS / "gsm8k_tool_config.yaml")}
    )
    tiny_config["actor_rollout_ref"]["rollout"]["multi_turn"] = multi_turn
    tiny_config["data"].update(
        {
            "train_files": [str(rows)],
            "val_files": [str(rows)],
            "max_prompt_length": 512,
            "max_response_length": 160,
        }
    )
    tiny_config["trainer"].update(
        {"test_freq": -1, "val_before_train": False, "guards": {"max_log_prob_gap": 100.0}}
        # the script's log-probs are not the model's
    )
    tiny_config["custom_reward_function"] = {"path": str(tmp_path / "reward.py")}
    return tiny_config


def scripted(monkeypatch, turns):
    """The policy writes turns(index of its question, its turn)."""
    # where every worker builds its agent loop
    import keel.distributed.rollout_worker as worker
    from keel.rollout.agent.loop import build_agent_loop

    def turn_for(context: str, turn: int) -> str:
        index = int(context.split("Question ")[1].split(":")[0])
        return turns(index, turn)

    monkeypatch.setattr(
        worker,
        "build_agent_loop",
        lambda multi_turn, engine, tokenizer, budget: build_agent_loop(
            multi_turn, ScriptedEngine(tokenizer, turn_for), tokenizer, budget
        ),
    )


def spy(monkeypatch, cls, name: str, seen: list, record):
    """cls.name still runs verl's own code; record(args, kwargs, result) is appended to `seen`."""
    original = getattr(cls, name)

    async def method(self, *args, **kwargs):
        result = await original(self, *args, **kwargs)
        seen.append(record(args, kwargs, result))
        return result

    monkeypatch.setattr(cls, name, method)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_verls_gsm8k_tool_and_tool_config_train_two_steps(tiny_config, tmp_path, monkeypatch):
    install_verl_0_5_0_files()
    from verl.tools.gsm8k_tool import Gsm8kTool

    created, executed, released = [], [], []
    spy(
        monkeypatch,
        Gsm8kTool,
        "create",
        created,
        lambda args, kwargs, result: (result, kwargs.get("ground_truth")),
    )
    spy(
        monkeypatch,
        Gsm8kTool,
        "execute",
        executed,
        lambda args, kwargs, result: (args[0], args[1]["answer"]),
    )
    spy(monkeypatch, Gsm8kTool, "release", released, lambda args, kwargs, result: args[0])
    scripted(
        monkeypatch,
        lambda index, turn: (
            f'<tool_call>{{"name": "calc_gsm8k_reward", "arguments": {{"answer": '
            f'"{solution(index)}"}}}}</tool_call>'
            if turn == 0
            else f"#### {solution(index)}"
        ),
    )
    cfg = verl_config(tiny_config, tmp_path, interaction=False, reward=TOOL_REWARD)
    [tools, _] = [f for f in run_checks(*load_run(cfg)).findings if f.check == "multi-turn"]
    assert (
        "calc_gsm8k_reward (verl Gsm8kTool: create, execute, calc_reward, release per sample)"
        in tools.message
    )
    # keel check says how verl's rewards are taken
    assert "not added to the score" in tools.message
    steps = metrics(train(cfg).run_dir)
    assert len(steps) == 2
    # 4 prompts x 4 samples a step, each calling verl's tool once, scored by its calc_reward
    for m in steps:
        assert (
            m["tools/calc_gsm8k_reward/calls"] == 16 and "tools/calc_gsm8k_reward/errors" not in m
        )
        assert (
            m["critic/score/mean"] == 1.0
            and m["tools/turn_reward/mean"] == 0.0
            and m["num_turns/mean"] == 4
        )
    # one per sample and tool
    assert len(created) == 32 and len({instance for instance, _ in created}) == 32
    ground_truths = dict(created)
    # create had the row's ground truth: the one the policy, reading that row's question, answered
    # with.
    assert (
        all(ground_truths[instance] == answer for instance, answer in executed)
        and len(executed) == 32
    )
    # every instance released
    assert sorted(released) == sorted(ground_truths)


def test_verls_gsm8k_interaction_and_interaction_config_train_two_steps(
    tiny_config, tmp_path, monkeypatch
):
    install_verl_0_5_0_files()
    from verl.interactions.gsm8k_interaction import Gsm8kInteraction

    started, finalized = [], []
    spy(
        monkeypatch,
        Gsm8kInteraction,
        "start_interaction",
        started,
        lambda args, kwargs, result: (result, kwargs["ground_truth"], kwargs["query"]),
    )
    spy(
        monkeypatch,
        Gsm8kInteraction,
        "finalize_interaction",
        finalized,
        lambda args, kwargs, result: args[0],
    )
    scripted(monkeypatch, lambda index, turn: "#### 0" if turn == 0 else f"#### {solution(index)}")
    steps = metrics(
        train(
            verl_config(tiny_config, tmp_path, interaction=True, reward=INTERACTION_REWARD)
        ).run_dir
    )
    assert len(steps) == 2
    # a wrong answer, verl's "incorrect" reply, the right answer: verl's scores 0 then 1
    for m in steps:
        assert m["environment/user_turns/mean"] == 1 and m["environment/errors"] == 0
        assert m["critic/score/mean"] == 1.0 and m["tools/turn_reward/mean"] == 0.0
    assert len(started) == 32 and all(
        query.startswith(f"Question {int(truth) // 3}:") for _, truth, query in started
    )
    assert sorted(finalized) == sorted(instance for instance, _, _ in started)


def test_verls_tool_config_without_verl_stops_training_with_keel_e012(
    tiny_config, tmp_path, monkeypatch
):
    for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
        monkeypatch.delitem(sys.modules, name)
    # not installed
    monkeypatch.setitem(sys.modules, "verl", None)
    with pytest.raises(KeelError) as error:
        train(verl_config(tiny_config, tmp_path, interaction=False, reward=TOOL_REWARD))
    assert error.value.code == VERL_UNAVAILABLE and "pip install --no-deps" in error.value.fix
