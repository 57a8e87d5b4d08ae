"""verl's own tool classes, function tools and interactions in keel's agent loop, unchanged.

verl 0.9.1 is installed without its dependencies; tests/verl_shim.py imports its tool modules, and
verl 0.5.0's gsm8k tool and interactions (tests/data/verl_0_5_0, which 0.9.1 no longer ships) on
top of 0.9.1's BaseTool. The engine is a script (conftest.ScriptedEngine): the turns a model would
write, so every call, create and release is the one verl's classes would see."""

import json
import sys
from pathlib import Path

import pytest

from keel.config.multi_turn import MultiTurnConfig
from keel.data.prompts import build_prompt_dataset, collate_prompts
from keel.errors import TOOL_CONFIG, VERL_UNAVAILABLE, KeelError
from keel.models.tiny import build_tokenizer
from keel.rollout.agent import AgentLoop, AgentOptions, ToolLimits, load_tool_config
from keel.rollout.agent.metrics import agent_metrics
from keel.rollout.agent.tools import load_tools
from keel.types import SamplingParams

from conftest import ScriptedEngine
from verl_shim import install_verl_0_5_0_files

VERL_CONFIGS = Path(__file__).parents[1] / "data" / "verl_multi_turn"
TOOL_CONFIG_YAML = VERL_CONFIGS / "gsm8k_tool_config.yaml"
INTERACTION_CONFIG_YAML = VERL_CONFIGS / "gsm8k_interaction_config.yaml"


@pytest.fixture
def verl():
    return install_verl_0_5_0_files()


def gsm8k_row(index: int, solution: str) -> dict:
    """A row as verl's examples/data_preprocess/gsm8k_multiturn_w_tool.py writes it."""
    question = (
        f"Question {index}: what is 8 times 9? "
        "Let's think step by step and output the final answer after `####`."
    )
    return {
        "data_source": "openai/gsm8k",
        "ability": "math",
        "prompt": [
            {
                "role": "system",
                "content": "You are a math expert. Use the `calc_gsm8k_reward` tool.",
            },
            {"role": "user", "content": question},
        ],
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {
            "split": "train",
            "index": index,
            "answer": f"8*9=72\n#### {solution}",
            "question": question,
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": solution}}},
            "interaction_kwargs": {"query": question, "ground_truth": solution},
        },
    }


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def rollout(
    rows: list[dict],
    turns: dict[int, list[str]],
    tools,
    limits: ToolLimits | None = None,
    budget: int = 400,
):
    """Episode i writes turns[i] in order (its prompt names its index)."""
    tokenizer = build_tokenizer()
    records, _ = build_prompt_dataset(rows, tokenizer, max_prompt_length=400)

    def turn_for(context: str, turn: int) -> str:
        index = next(i for i in turns if f"Question {i}:" in context)
        return turns[index][min(turn, len(turns[index]) - 1)]

    loop = AgentLoop(
        ScriptedEngine(tokenizer, turn_for),
        tokenizer,
        tools,
        AgentOptions(max_assistant_turns=4, budget=budget, limits=limits or ToolLimits()),
        [tokenizer.eos_token_id],
    )
    batch = loop.generate(
        collate_prompts(records, tokenizer.pad_token_id), SamplingParams(do_sample=False)
    )
    return [r.extra_info for r in batch.records], batch


def test_verls_gsm8k_tool_from_verls_config_runs_its_lifecycle_and_rewards_as_verl(verl):
    """verl's YAML builds verl's class with verl's schema object; each episode gets its own
    instance, created with the row's ground truth; the model reads the ToolResponse text; the step
    rewards and calc_reward are recorded where verl puts them, none added to the score; all
    released."""
    [tool] = load_tool_config(TOOL_CONFIG_YAML)
    from verl.tools.gsm8k_tool import Gsm8kTool
    from verl.tools.schemas import OpenAIFunctionToolSchema

    assert isinstance(tool.tool, Gsm8kTool) and isinstance(
        tool.tool.tool_schema, OpenAIFunctionToolSchema
    )
    assert tool.schema["function"]["parameters"]["required"] == ["answer"]
    infos, _ = rollout(
        [gsm8k_row(0, "72"), gsm8k_row(1, "18")],
        {
            0: [
                call("calc_gsm8k_reward", answer="70"),
                call("calc_gsm8k_reward", answer="72"),
                "#### 72",
            ],
            1: [call("calc_gsm8k_reward", answer="18"), "#### 18"],
        },
        [tool],
    )
    first, second = infos
    assert first["tool_outputs"] == [
        "Current parsed answer='70' reward=0.0",
        "Current parsed answer='72' reward=1.0",
    ]
    # verl's gsm8k: -0.05 for an answer that is no better
    assert first["tool_rewards"] == [-0.05, 0.0]
    # calc_reward after the last turn
    assert first["rollout_reward_scores"] == {"calc_gsm8k_reward": 1.0}
    assert second["tool_rewards"] == [0.0] and second["rollout_reward_scores"] == {
        "calc_gsm8k_reward": 1.0
    }
    # as verl: nothing added to the score
    assert first["turn_reward"] == 0.0 and second["turn_reward"] == 0.0
    # every instance released
    assert tool.tool._instance_dict == {}
    assert (
        first["tools"]["calc_gsm8k_reward"]["error"] == 0
        and first["tools"]["calc_gsm8k_reward"]["calls"] == 2
    )


def test_verls_gsm8k_interaction_from_verls_config_is_scored_as_verl(verl):
    from keel.rollout.agent.interaction import InteractionEnvironment, load_interactions

    interactions = load_interactions(INTERACTION_CONFIG_YAML)
    assert type(interactions["gsm8k"]).__module__ == "verl.interactions.gsm8k_interaction"
    tokenizer = build_tokenizer()
    rows = [gsm8k_row(0, "72")]
    # gsm8k_multiturn_w_interaction.py's row
    rows[0]["extra_info"]["interaction_kwargs"]["name"] = "gsm8k"
    records, _ = build_prompt_dataset(rows, tokenizer, max_prompt_length=400)
    engine = ScriptedEngine(tokenizer, lambda text, turn: ["#### 70", "#### 72"][min(turn, 1)])
    loop = AgentLoop(
        engine,
        tokenizer,
        [],
        AgentOptions(max_assistant_turns=4, budget=300),
        [tokenizer.eos_token_id],
        InteractionEnvironment,
        {"interactions": interactions, "timeout_s": 5.0},
    )
    [info] = [
        r.extra_info
        for r in loop.generate(
            collate_prompts(records, tokenizer.pad_token_id), SamplingParams(do_sample=False)
        ).records
    ]
    assert [m["content"] for m in info["conversation"]][:2] == [
        "#### 70",
        "Your response is incorrect! You need to reflect on your answer and try again.",
    ]
    assert (
        info["rollout_reward_scores"] == {"user_turn_rewards": [0.0, 1.0]}
        and info["turn_reward"] == 0.0
    )
    # finalised
    assert interactions["gsm8k"]._instance_dict == {}


def _verl_modules() -> list[str]:
    return [n for n in sys.modules if n == "verl" or n.startswith("verl.")]


@pytest.fixture
def verl_unloaded(monkeypatch):
    """verl's modules out of sys.modules for the test (the shim's are put back after it, and what
    the test's own imports left is removed)."""
    for name in _verl_modules():
        monkeypatch.delitem(sys.modules, name)
    yield monkeypatch
    for name in _verl_modules():
        sys.modules.pop(name, None)


@pytest.fixture
def without_verl(verl_unloaded):
    """verl not importable: not installed (None in sys.modules stops its import)."""
    verl_unloaded.setitem(sys.modules, "verl", None)


def test_verls_configs_without_verl_are_keel_e012(without_verl, tmp_path):
    for load, path in [(load_tool_config, TOOL_CONFIG_YAML)]:
        with pytest.raises(KeelError) as error:
            load(path)
        assert (
            error.value.code == VERL_UNAVAILABLE
            and "verl.tools.gsm8k_tool.Gsm8kTool needs verl" in str(error.value)
        )
        assert (
            "pip install --no-deps 'verl==0.9.1'" in error.value.fix
            and "pydantic" in error.value.fix
        )
    from keel.rollout.agent.interaction import load_interactions

    with pytest.raises(KeelError) as error:
        load_interactions(INTERACTION_CONFIG_YAML)
    assert error.value.code == VERL_UNAVAILABLE and "not installed" in error.value.message
    (tmp_path / "functions.py").write_text("from verl.tools.function_tool import function_tool\n")
    with pytest.raises(KeelError) as error:
        load_tools(MultiTurnConfig(function_tool_path=str(tmp_path / "functions.py")))
    assert error.value.code == VERL_UNAVAILABLE
    (tmp_path / "mine.py").write_text(
        "from verl.tools.base_tool import BaseTool\n\nclass Mine(BaseTool):\n    pass\n"
    )
    (tmp_path / "tools.yaml").write_text("tools:\n  - class_name: mine.py:Mine\n")
    # the user's own file, built on verl's BaseTool
    with pytest.raises(KeelError) as error:
        load_tool_config(tmp_path / "tools.yaml")
    assert error.value.code == VERL_UNAVAILABLE and "mine.py needs verl" in error.value.message


def test_verl_installed_but_missing_a_package_it_imports_is_keel_e012_naming_it(verl_unloaded):
    import importlib.util

    if importlib.util.find_spec("verl") is None:
        pytest.skip("verl is not installed (make install: pip install --no-deps verl)")
    # what verl's package imports first
    verl_unloaded.setitem(sys.modules, "tensordict", None)
    with pytest.raises(KeelError) as error:
        load_tool_config(TOOL_CONFIG_YAML)
    assert (
        error.value.code == VERL_UNAVAILABLE
        and "installed but cannot be imported" in error.value.message
    )
    assert "tensordict" in error.value.message and error.value.fix == "pip install tensordict"


FUNCTIONS = '''
from verl.tools.function_tool import function_tool
from verl.tools.schemas import ToolResponse


@function_tool
def keel_test_multiply(a: int, b: int) -> str:
    """Multiplies two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return str(a * b)


@function_tool("keel_test_lookup")
async def lookup(key: str):
    """Looks a key up.

    Args:
        key: what to look up
    """
    return ToolResponse(text=f"{key}=1"), 0.5, {"hits": 1}
'''


def test_function_tool_paths_functions_become_tools(verl, tmp_path):
    """verl 0.9.1's @function_tool functions, loaded by verl's own loader, are tools beside the tool
    config's, called as verl calls them; their step rewards are recorded, not scored."""
    (tmp_path / "functions.py").write_text(FUNCTIONS)
    multi_turn = MultiTurnConfig(
        tool_config_path=str(TOOL_CONFIG_YAML), function_tool_path=str(tmp_path / "functions.py")
    )
    tools = load_tools(multi_turn)
    assert [t.name for t in tools] == [
        "calc_gsm8k_reward",
        "keel_test_lookup",
        "keel_test_multiply",
    ]
    from keel.rollout.agent import build_agent_loop

    # the loop a training run builds from the config takes them too
    tokenizer = build_tokenizer()
    built = build_agent_loop(
        multi_turn, ScriptedEngine(tokenizer, lambda text, turn: ""), tokenizer, 64
    )
    assert sorted(built.runner.tools) == [
        "calc_gsm8k_reward",
        "keel_test_lookup",
        "keel_test_multiply",
    ]
    assert tools[2].schema["function"]["parameters"]["properties"]["a"] == {
        "type": "integer",
        "description": "the first number",
    }
    infos, _ = rollout(
        [gsm8k_row(0, "72")],
        {0: [call("keel_test_multiply", a=8, b=9) + call("keel_test_lookup", key="x"), "#### 72"]},
        tools,
        ToolLimits(max_parallel_calls=2),
    )
    assert infos[0]["tool_outputs"] == ["72", "x=1"] and infos[0]["tool_rewards"] == [0.0, 0.5]
    assert infos[0]["turn_reward"] == 0.0


@pytest.mark.parametrize(
    "text, needle",
    [
        ("def f(x: int) -> int:\n    return x\n", "registers no function tools"),
        (
            "from verl.tools.function_tool import function_tool\n@function_tool\ndef "
            "keel_test_bare(x: int) -> int:\n    return x\n",
            "could not be loaded as verl's function tools",
            # no docstring: transformers refuses
        ),
        ("raise RuntimeError('broken file')\n", "RuntimeError: broken file"),
    ],
)
def test_a_function_tool_file_that_gives_no_tools_is_refused_by_name(verl, tmp_path, text, needle):
    (tmp_path / "functions.py").write_text(text)
    with pytest.raises(KeelError) as error:
        load_tools(MultiTurnConfig(function_tool_path=str(tmp_path / "functions.py")))
    assert error.value.code == TOOL_CONFIG and needle in error.value.message


def test_a_function_tool_named_like_a_config_tool_is_refused(verl, tmp_path):
    # verl's registry is one per process: these functions are named apart from the other tests'.
    (tmp_path / "functions.py").write_text(
        FUNCTIONS.replace("keel_test_multiply", "keel_test_twice_multiply").replace(
            '"keel_test_lookup"', '"calc_gsm8k_reward"'
        )
    )
    with pytest.raises(KeelError) as error:
        load_tools(
            MultiTurnConfig(
                tool_config_path=str(TOOL_CONFIG_YAML),
                function_tool_path=str(tmp_path / "functions.py"),
            )
        )
    assert error.value.code == TOOL_CONFIG and "share a name" in error.value.message


HOSTILE = """
import asyncio

from verl.tools.base_tool import BaseTool


class Recording(BaseTool):
    async def release(self, instance_id, **kwargs):
        self.__dict__.setdefault("released", []).append(instance_id)


class CreateRaises(Recording):
    async def create(self, instance_id=None, **kwargs):
        raise RuntimeError("no room for another instance")


class CreateHangs(Recording):
    async def create(self, instance_id=None, **kwargs):
        await asyncio.Event().wait()


class ExecuteHangs(Recording):
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.Event().wait()


class ExecuteAnswersNonsense(Recording):
    async def execute(self, instance_id, parameters, **kwargs):
        return 42, float("nan"), {}


class ReleaseRaises(BaseTool):
    async def release(self, instance_id, **kwargs):
        raise KeyError(instance_id)


class ReleaseHangs(BaseTool):
    def release(self, instance_id, **kwargs):  # a plain method that blocks: on a thread, cut
        import time
        time.sleep(2)


class RewardIsNaN(Recording):
    async def calc_reward(self, instance_id, **kwargs):
        return float("nan")
"""
HOSTILE_TOOLS = [
    "CreateRaises",
    "CreateHangs",
    "ExecuteHangs",
    "ExecuteAnswersNonsense",
    "ReleaseRaises",
    "ReleaseHangs",
    "RewardIsNaN",
]


def test_a_verl_tool_that_raises_or_hangs_anywhere_in_its_lifecycle_is_counted_not_fatal(
    verl, tmp_path
):
    (tmp_path / "hostile.py").write_text(HOSTILE)
    (tmp_path / "tools.yaml").write_text(
        "tools:\n"
        + "".join(
            f"  - class_name: hostile.py:{name}\n    config: {{type: native}}\n    tool_schema: "
            f"{{type: function, function: {{name: {name.lower()}, description: x, parameters: "
            "{type: object, properties: {}}}}\n"
            for name in HOSTILE_TOOLS
        )
    )
    tools = load_tool_config(tmp_path / "tools.yaml")
    every_call = "".join(call(name.lower()) for name in HOSTILE_TOOLS)
    infos, batch = rollout(
        [gsm8k_row(0, "72"), gsm8k_row(1, "72")],
        {0: [every_call, "#### 72"], 1: ["#### 72"]},
        tools,
        ToolLimits(max_parallel_calls=len(HOSTILE_TOOLS), timeout_s=0.5),
        budget=1500,
    )
    released = {t.tool.name: getattr(t.tool, "released", []) for t in tools}
    outputs = dict(zip([n.lower() for n in HOSTILE_TOOLS], infos[0]["tool_outputs"]))
    assert (
        "could not start" in outputs["createraises"]
        and "no room for another instance" in outputs["createraises"]
    )
    assert (
        "could not start" in outputs["createhangs"]
        and "took longer than 0.5 s" in outputs["executehangs"]
    )
    assert "not a ToolResponse or a string" in outputs["executeanswersnonsense"]
    counts = {name: infos[0]["tools"][name] for name in outputs}
    # its call and its create
    assert counts["createraises"]["error"] == 2 and counts["createhangs"]["timeout"] == 1
    assert counts["createhangs"]["error"] == 1 and counts["executehangs"]["timeout"] == 1
    assert counts["releaseraises"]["error"] == 1 and counts["releasehangs"]["timeout"] == 1
    assert (
        counts["rewardisnan"]["error"] == 1
        and "rewardisnan" not in infos[0]["rollout_reward_scores"]
    )
    # the episode that calls nothing: its create, counted
    assert infos[1]["tools"]["createhangs"]["timeout"] == 1
    # Released: every instance whose create did not raise, the hung create's and the hung execute's
    # too.
    assert released["createraises"] == [] and len(released["executeanswersnonsense"]) == 2
    assert len(released["createhangs"]) == 2 and len(released["executehangs"]) == 2
    # the episode went on to its answer
    assert batch.records[0].extra_info["num_turns"] == 4
    metrics = agent_metrics(batch.records)
    assert (
        metrics["tools/executehangs/timeouts"] == 1 and metrics["tools/releaseraises/errors"] == 2
    )
