"""Multi-turn GRPO end to end on CPU: keel check and keel train with verl's multi_turn keys and a
tool config in verl's format; a policy that calls the calculator (scripted turns, the tiny model
scoring them) trains on its own tokens only, with the tool's result in its context and its
reward."""

import json
import math
from pathlib import Path

from keel.api import train

from conftest import ScriptedEngine

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # the final answer, and the loop's record of the episode (verl's extra_info.num_turns)
    return float("The answer is 408" in solution_str) + 0.01 * extra_info["num_turns"]
"""


def multi_turn_config(tiny_config, tmp_path: Path) -> dict:
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: keel.tools.Calculator\n    config: {type: native}\n")
    tiny_config["actor_rollout_ref"]["rollout"]["multi_turn"] = {
        "enable": True,
        "tool_config_path": str(tools),
        "max_assistant_turns": 3,
        "format": "hermes",
    }
    tiny_config["data"]["max_response_length"] = 192
    tiny_config["trainer"].update({"test_freq": -1, "val_before_train": False})
    return tiny_config


def interaction_config(tiny_config, tmp_path: Path) -> dict:
    """Multi-turn with verl's interaction (nudge.py's Nudge, an environment) instead of tools."""
    (tmp_path / "nudge.py").write_text(NUDGE)
    interactions = tmp_path / "interactions.yaml"
    interactions.write_text(
        "interaction:\n  - name: nudge\n    class_name: nudge.py:Nudge\n    config: {}\n"
    )
    cfg = multi_turn_config(tiny_config, tmp_path)
    multi_turn = cfg["actor_rollout_ref"]["rollout"]["multi_turn"]
    del multi_turn["tool_config_path"]
    multi_turn.update({"interaction_config_path": str(interactions), "max_tokens_per_turn": 16})
    return cfg


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_keel_check_and_train_take_verls_multi_turn_keys(tiny_config, tmp_path):
    from keel.check.preflight import run_checks
    from keel.config.load import load_run

    cfg = multi_turn_config(tiny_config, tmp_path)
    found = [f for f in run_checks(*load_run(cfg)).findings if f.check == "multi-turn"]
    assert [f.level for f in found] == ["pass", "pass"] and "token-in/token-out" in found[1].message
    steps = metrics(train(cfg).run_dir)
    # the prompt and an answer at least
    assert len(steps) == 2 and all(m["num_turns/min"] >= 2 for m in steps)


def test_a_tool_calling_policy_trains_on_its_own_tokens(tiny_config, tmp_path, monkeypatch):
    """The engine writes a calculator call, then the answer; the tiny model's log-probs of those
    tokens are trained, the tool's output and the template's tokens are only context."""
    # where every worker builds its agent loop
    import keel.distributed.rollout_worker as worker
    from keel.rollout.agent.loop import build_agent_loop

    def scripted_loop(multi_turn, engine, tokenizer, budget):
        answers = {0: CALL, 1: "The answer is 408"}
        return build_agent_loop(
            multi_turn,
            ScriptedEngine(tokenizer, lambda text, turn: answers[min(turn, 1)]),
            tokenizer,
            budget,
        )

    monkeypatch.setattr(worker, "build_agent_loop", scripted_loop)
    cfg = multi_turn_config(tiny_config, tmp_path)
    (tmp_path / "reward.py").write_text(REWARD)
    cfg["custom_reward_function"] = {"path": str(tmp_path / "reward.py")}
    # the script's log-probs are not the model's
    cfg["trainer"]["guards"] = {"max_log_prob_gap": 100.0}
    steps = metrics(train(cfg).run_dir)
    last = steps[-1]
    # 4 prompts x 4 samples
    assert last["tools/calculator/calls"] == 16 and last["num_turns/mean"] == 4
    assert "tools/calculator/errors" not in last and last["tools/malformed_calls"] == 0
    # the answer after the tool, 4 turns
    assert math.isclose(last["critic/score/mean"], 1.04, abs_tol=1e-6)
    assert all(math.isfinite(m["actor/pg_loss"]) for m in steps)
    # keel's tokenizer: a token per byte at most
    answer_tokens = len(CALL) + len("The answer is 408")
    # the model's tokens only, not the tool's
    assert last["response_length/mean"] <= answer_tokens + 2


def test_the_examples_tool_config_holds_a_builtin_and_a_custom_tool():
    from keel.rollout.agent import load_tool_config
    from keel.rollout.agent.parse import ToolCall
    from keel.rollout.agent.runner import ToolLimits, ToolRunner

    tools = load_tool_config(Path(__file__).parents[2] / "examples" / "tools" / "tools.yaml")
    assert [t.name for t in tools] == ["calculator", "convert_units"]
    runner = ToolRunner(tools, ToolLimits(max_parallel_calls=2))
    [[converted, refused]] = runner.run(
        [
            [
                ToolCall("convert_units", {"value": 10, "from": "km", "to": "mi"}),
                ToolCall("convert_units", {"value": 1, "from": "km", "to": "kg"}),
            ]
        ],
        [{}],
    )
    assert converted.text == "6.21 mi" and converted.status == "ok"
    assert refused.status == "error" and "cannot convert km to kg" in refused.text


NUDGE = """
class Nudge:  # verl's interaction protocol: async methods, one instance for every episode
    def __init__(self, config):
        self.config, self.turns = config, {}

    async def start_interaction(self, instance_id=None, **kwargs):
        self.turns[instance_id] = 0
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        self.turns[instance_id] += 1
        return self.turns[instance_id] >= 2, "try once more", 0.5, {}

    async def finalize_interaction(self, instance_id, **kwargs):
        del self.turns[instance_id]
"""


NUDGE_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(extra_info["rollout_reward_scores"].get("user_turn_rewards", []))
"""


def test_verls_interaction_config_gives_user_turns_in_check_and_train(tiny_config, tmp_path):
    """interaction_config_path in verl's format, its class in a file beside it: keel check names it,
    and training runs episodes of assistant turns answered by it (the native engine on CPU, its
    turns scheduled by continuous batching); its scores reach the reward function where verl puts
    them (extra_info.rollout_reward_scores) and are not added to the score, as in verl."""
    from keel.check.preflight import run_checks
    from keel.config.load import load_run

    cfg = interaction_config(tiny_config, tmp_path)
    (tmp_path / "reward.py").write_text(NUDGE_REWARD)
    cfg["custom_reward_function"] = {"path": str(tmp_path / "reward.py")}
    found = [f for f in run_checks(*load_run(cfg)).findings if f.check == "multi-turn"]
    assert "verl interactions nudge" in found[0].message
    steps = metrics(train(cfg).run_dir)
    assert len(steps) == 2
    # each episode: a turn, "try once more", a turn, then the interaction ends it
    for m in steps:
        assert (
            m["environment/user_turns/mean"] == 1
            and m["num_turns/max"] == 4
            and m["environment/errors"] == 0
        )
        # nothing added to the score, as in verl
        assert m["tools/turn_reward/mean"] == 0.0
        # the reward function's sum of the two answers' 0.5
        assert m["critic/score/mean"] == 1.0


def test_the_examples_interaction_config_asks_for_a_second_look_once():
    import asyncio

    from keel.config.load import load_config
    from keel.rollout.agent.interaction import load_interactions

    root = Path(__file__).parents[2] / "examples" / "interaction"
    cfg = load_config(root / "grpo.yaml")
    assert cfg.actor_rollout_ref.rollout.multi_turn.interaction_config_path.endswith(
        "interactions.yaml"
    )
    second_look = load_interactions(root / "interactions.yaml")["second_look"]
    asyncio.run(second_look.start_interaction("a"))
    replies = [
        asyncio.run(second_look.generate_response("a", [{"role": "assistant", "content": "4"}]))
        for _ in range(2)
    ]
    assert [done for done, *_ in replies] == [False, True] and "Look again" in replies[0][1]
