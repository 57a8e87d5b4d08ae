"""The agent loop: tool calls parsed, run and answered through the chat template, token-in/token-out
(the trained tokens are the sampled ones plus exactly the template's between turns, for Qwen2.5's,
Llama 3's and keel's own templates), masks over tool output, and every bad tool counted, never
raised.

The engine here is a script (conftest.ScriptedEngine): it answers each context with the next turn
written for its prompt, so the loop is tested on the turns a trained model would write."""

import json
import threading

import pytest
import torch

from keel.data.prompts import build_prompt_dataset, collate_prompts
from keel.errors import NO_TOOL_ROLE, TOOL_CONFIG, KeelError
from keel.models.tiny import build_tokenizer
from keel.rollout.agent import (
    AgentLoop,
    AgentOptions,
    Calculator,
    ToolLimits,
    load_tool_config,
    tool,
)
from keel.rollout.agent.metrics import agent_metrics
from keel.rollout.agent.template import TurnTemplate, first_difference, round_trip
from keel.types import SamplingParams

from conftest import LOG_PROB, ScriptedEngine

CALC = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'


def rollout(
    script: dict[str, list[str]],
    tools,
    budget: int = 200,
    limits: ToolLimits | None = None,
    n: int = 1,
):
    tokenizer = build_tokenizer()
    records, _ = build_prompt_dataset(
        [{"prompt": [{"role": "user", "content": p}]} for p in script],
        tokenizer,
        max_prompt_length=64,
    )

    def turn_for(context: str, turn: int) -> str:
        return script[next(p for p in script if p in context)][turn]

    loop = AgentLoop(
        ScriptedEngine(tokenizer, turn_for),
        tokenizer,
        tools,
        AgentOptions(max_assistant_turns=4, budget=budget, limits=limits or ToolLimits()),
        [tokenizer.eos_token_id],
    )
    prompts = collate_prompts(records, tokenizer.pad_token_id).repeat_interleave(n)
    return loop.generate(prompts, SamplingParams(do_sample=False, max_new_tokens=budget)), tokenizer


def test_a_tool_call_is_answered_and_the_trained_tokens_are_the_templates():
    batch, tokenizer = rollout({"What is 12*34?": [CALC, "The answer is 408"]}, [Calculator()])
    messages = [
        {"role": "user", "content": "What is 12*34?"},
        {"role": "assistant", "content": CALC},
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": "The answer is 408"},
    ]
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    expected = tokenizer.encode(whole, add_special_tokens=False)
    built = (
        batch.prompt_ids[0][batch.prompt_mask[0].bool()].tolist()
        + batch.response_ids[0][batch.response_attention[0].bool()].tolist()
    )
    # all but the final "\n"
    assert first_difference(built, expected) is None and len(built) == len(expected) - 1
    trained = batch.response_ids[0][batch.response_mask[0].bool()]
    turns = [
        tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id]
        for t in (CALC, messages[3]["content"])
    ]
    # the model's tokens exactly, and only them
    assert trained.tolist() == turns[0] + turns[1]
    suffix = batch.response_ids[0][(batch.response_attention[0] - batch.response_mask[0]).bool()]
    assert "408" in tokenizer.decode(suffix) and "<|im_start|>assistant" in tokenizer.decode(suffix)
    assert torch.all(batch.sampling_log_probs[0][batch.response_mask[0].bool()] == LOG_PROB)
    assert torch.all(batch.sampling_log_probs[0][~batch.response_mask[0].bool()] == 0)
    info = batch.records[0].extra_info
    assert info["num_turns"] == 4 and info["tool_calls"] == 1 and not info["cut_by_budget"]
    assert info["conversation"] == messages[1:] and info["last_turn"] == "The answer is 408"
    # the reward's position
    assert batch.last_token_index[0] == batch.response_attention[0].sum() - 1
    metrics = agent_metrics(batch.records)
    assert metrics["tools/calculator/calls"] == 1 and metrics["num_turns/mean"] == 4


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_every_bad_tool_is_fed_back_and_counted():
    release = threading.Event()

    @tool
    def explode(x: int) -> str:
        """Raises."""
        raise RuntimeError("boom")

    @tool
    def hang(x: int) -> str:
        """Never answers in time."""
        release.wait(60)
        return "late"

    @tool
    def flood(x: int) -> str:
        """Far too much output."""
        return "A" * 1000 + "END"

    script = {
        "p1": [call("explode", x=1), "done"],
        "p2": [call("hang", x=1), "done"],
        "p3": [call("flood", x=1), "done"],
        "p4": [call("rm_rf", path="/"), "done"],
        "p5": ['<tool_call>{"name": "flood", "arguments": {oops</tool_call>', "done"],
        "p6": [call("flood", x=1) + call("flood", x=2) + call("flood", x=3), "done"],
    }
    try:
        batch, tokenizer = rollout(
            script,
            [explode, hang, flood],
            budget=1000,
            limits=ToolLimits(max_parallel_calls=2, timeout_s=0.5, max_response_chars=40),
        )
    finally:
        release.set()
    fed_back = {
        p: tokenizer.decode(
            batch.response_ids[i][(batch.response_attention[i] - batch.response_mask[i]).bool()]
        )
        for i, p in enumerate(script)
    }
    assert "RuntimeError: boom" in fed_back["p1"]
    assert "took longer than 0.5 s" in fed_back["p2"]
    assert (
        "...(truncated)" in fed_back["p3"]
        and "END" in fed_back["p3"]
        and "A" * 100 not in fed_back["p3"]
    )
    assert "no tool named 'rm_rf'" in fed_back["p4"]
    assert "not valid JSON" in fed_back["p5"]
    # max_parallel_calls=2 of the 3
    assert fed_back["p6"].count("(truncated)") == 2
    # each answered after
    assert all(batch.records[i].extra_info["num_turns"] == 4 for i in range(len(script)))
    metrics = agent_metrics(batch.records)
    assert metrics["tools/explode/errors"] == 1 and metrics["tools/hang/timeouts"] == 1
    assert metrics["tools/flood/truncateds"] == 3 and metrics["tools/unknown_tool/unknowns"] == 1
    assert metrics["tools/malformed_calls"] == 1


def test_the_budget_ends_an_episode_and_says_so():
    batch, _ = rollout({"q": [CALC, "The answer is 408"]}, [Calculator()], budget=len(CALC) // 2)
    assert batch.truncated[0] and batch.records[0].extra_info["cut_by_budget"]
    assert [m["role"] for m in batch.records[0].extra_info["conversation"]] == ["assistant"]
    assert batch.response_mask[0].sum() <= len(CALC) // 2


@pytest.mark.parametrize(
    "expression, needle",
    [
        ("__import__('os').system('id')", "not arithmetic"),
        # powers are not offered: no unbounded work
        ("9**9**9", "not arithmetic"),
        ("10000000000*10000000000*10000000000*10000000000", "too large"),
        ("1+" * 200 + "1", "longer than"),
        ("(lambda: 1)()", "not arithmetic"),
    ],
)
def test_the_calculator_refuses_what_is_not_arithmetic(expression, needle):
    with pytest.raises(ValueError, match=needle):
        Calculator().execute({"expression": expression})
    assert Calculator().execute({"expression": "(12 + 3) * 4 - 6 / 3"}) == "58"


QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}"
    "{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.'
    "\\n\\nYou are provided "
    'with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}'
    '{{- tool | tojson }}{%- endfor %}{{- "\\n</tools>\\n\\nFor each function call, '
    "return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags:"
    '\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}{%- else %}'
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n"
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}{{- '\\n<tool_response>\\n' }}{{- message.content }}"
    "{{- '\\n</tool_response>' }}{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{{- 'Cutting "
    "Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}{{- '<|eot_id|>' }}{%- for "
    "message in messages %}{%- if message.role == 'ipython' or message.role == 'tool' %}{{- "
    "'<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}{{- message.content }}{{- '<|eot_id|>' "
    "}}{%- else %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{%- endif %}{%- endfor %}{%- if "
    "add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- "
    "endif %}"
)


def tokenizer_with(template: str | None):
    tokenizer = build_tokenizer()
    if template == "llama3":
        tokenizer.add_special_tokens(
            {
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
                "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"],
            }
        )
        tokenizer.chat_template = LLAMA3_TEMPLATE
    elif template == "qwen2.5":
        tokenizer.chat_template = QWEN25_TEMPLATE
    return tokenizer


@pytest.mark.parametrize("template", ["qwen2.5", "llama3", "keel"])
def test_turn_by_turn_tokens_equal_the_templates_rendering_of_the_conversation(template):
    """What keel check runs on the run's tokenizer: the loop's sequence against apply_chat_template
    of the same messages, and the first position where they differ (none here; a dropped separator
    is found where it was dropped)."""
    tokenizer = tokenizer_with(template)
    built, reference = round_trip(tokenizer, [Calculator().schema])
    assert first_difference(built, reference) is None and len(reference) - len(built) in (0, 1)
    user = [{"role": "user", "content": "What is 12*34?"}]
    prompt = tokenizer.apply_chat_template(
        user, tools=[Calculator().schema], tokenize=False, add_generation_prompt=True
    )
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    # the template's first token after the turn's end
    separator = len(encode(prompt) + encode(CALC)) + 1
    # verl #6921: the newline after the end token lost
    dropped = built[:separator] + built[separator + 1 :]
    # Llama 3 puts no separator there
    if template != "llama3":
        assert first_difference(dropped, reference) == separator


def test_a_template_without_a_tool_role_is_refused_by_name():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role in ['user', 'assistant'] %}<|im_start|>{{ m.role }}"
        "\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(KeelError) as error:
        TurnTemplate(tokenizer, None, [tokenizer.eos_token_id])
    assert error.value.code == NO_TOOL_ROLE and "drops tool messages" in error.value.message


def test_the_turn_end_is_whichever_stop_token_the_template_uses():
    """Qwen2.5-Instruct stops at <|endoftext|> or <|im_end|>; its turns end with <|im_end|>. A model
    that stops only at a token its template never ends a turn with cannot be joined turn to turn."""
    tokenizer = build_tokenizer()
    endoftext, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert TurnTemplate(tokenizer, None, [endoftext, im_end]).end_id == im_end
    with pytest.raises(KeelError) as error:
        TurnTemplate(tokenizer, None, [endoftext])
    assert error.value.code == NO_TOOL_ROLE and "none of the stop tokens" in error.value.message


def test_tool_configs_in_verls_format_and_in_python(tmp_path):
    good = tmp_path / "tools.yaml"
    good.write_text("tools:\n  - class_name: keel.tools.Calculator\n    config: {}\n")
    assert [t.name for t in load_tool_config(good)] == ["calculator"]
    python = tmp_path / "my_tools.py"
    python.write_text(
        "from keel.rollout.agent import tool\n\n@tool\ndef add(a: int, b: int = 0) -> str:\n"
        "    '''Adds two numbers.'''\n    return str(a + b)\n"
    )
    [add] = load_tool_config(python)
    assert add.schema["function"]["parameters"] == {
        "type": "object",
        "required": ["a"],
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    }
    assert add.execute({"a": 2, "b": 3}) == "5"
    cases = {
        "missing.yaml": (
            "tools:\n  - class_name: keel.tools.Nope\n",
            "names no class with the method execute()",
        ),
        "empty.yaml": ("tools: []\n", "no `tools:` list"),
        "untyped.py": (
            "from keel.rollout.agent import tool\n@tool\ndef f(x):\n    return x\n",
            "type hint",
        ),
        "twice.yaml": ("tools:\n" + "  - class_name: keel.tools.Calculator\n" * 2, "share a name"),
    }
    for name, (text, needle) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(KeelError) as error:
            load_tool_config(tmp_path / name)
        assert error.value.code == TOOL_CONFIG and needle in error.value.message, name


def test_an_async_tool_and_a_verl_style_result_are_taken():
    from keel.rollout.agent import Tool
    from keel.rollout.agent.parse import ToolCall
    from keel.rollout.agent.runner import ToolRunner

    class Echo(Tool):
        schema = {
            "type": "function",
            "function": {"name": "echo", "parameters": {"type": "object"}},
        }

        async def execute(self, parameters: dict, **kwargs):
            return {"echoed": parameters["x"]}, 0.5, {"note": "verl's (response, reward, metrics)"}

    [[output]] = ToolRunner([Echo()], ToolLimits()).run([[ToolCall("echo", {"x": 7})]], [{}])
    assert (output.text, output.reward, output.status) == ('{"echoed": 7}', 0.5, "ok")


@pytest.mark.parametrize(
    "code, needle",
    [
        ("print(sum(range(10)))", "45"),
        # the host's files
        ("print(open('/etc/shadow').read())", "Error"),
        # the network
        ("import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)", "Error"),
        # a fork bomb
        ("import os\nwhile True: os.fork()", "Error"),
        # CPU
        ("while True: pass", "stopped"),
        # output
        ("print('x' * 10**8)", "stopped"),
    ],
)
def test_the_python_tool_runs_model_code_in_the_sandbox(code, needle):
    """The attack, not just the happy path: what the model writes runs jailed, and every escape it
    tries ends as text it reads back."""
    from keel.rollout.agent import PythonCode
    from keel.rollout.agent.parse import ToolCall
    from keel.rollout.agent.runner import ToolRunner

    tool = PythonCode({"cpu_s": 2, "wall_s": 5})
    [[output]] = ToolRunner([tool], ToolLimits(timeout_s=60, max_response_chars=400)).run(
        [[ToolCall("python", {"code": code})]], [{}]
    )
    assert needle in output.text, output.text
    if needle != "45":
        assert "root:" not in output.text


class GuessTheNumber:
    """An environment: the model guesses, it answers higher / lower, 1 for the right number."""

    def __init__(self, config=None):
        self.config = config or {}

    def reset(self, extra_info: dict) -> None:
        self.secret = extra_info["secret"]
        if self.secret < 0:
            raise ValueError("a broken row")

    def step(self, text: str):
        guess = int(text.strip())
        if guess == self.secret:
            return "correct", 1.0, True
        return ("higher" if guess < self.secret else "lower"), 0.0, False


def test_an_environment_answers_turns_without_tool_calls():
    tokenizer = build_tokenizer()
    guesses = {
        "game one": ["50", "75", "62"],
        "game two": ["50", "twenty"],
        "game three": ["1", "2", "3"],
    }
    rows = [
        {"prompt": [{"role": "user", "content": p}], "extra_info": {"secret": secret}}
        for p, secret in [("game one", 62), ("game two", 20), ("game three", 99)]
    ]
    records, _ = build_prompt_dataset(rows, tokenizer, max_prompt_length=64)
    engine = ScriptedEngine(
        tokenizer, lambda text, turn: guesses[next(p for p in guesses if p in text)][turn]
    )
    loop = AgentLoop(
        engine,
        tokenizer,
        [],
        AgentOptions(max_assistant_turns=5, max_user_turns=2, budget=200),
        [tokenizer.eos_token_id],
        GuessTheNumber,
    )
    batch = loop.generate(
        collate_prompts(records, tokenizer.pad_token_id), SamplingParams(do_sample=False)
    )
    one, two, three = (r.extra_info for r in batch.records)
    assert [m["content"] for m in one["conversation"]] == ["50", "higher", "75", "lower", "62"]
    assert one["turn_reward"] == 1.0 and one["user_turns"] == 2 and one["num_turns"] == 6
    # added to the score on the last token
    assert batch.turn_rewards.tolist() == [1.0, 0.0, 0.0]
    # int("twenty") raised
    assert two["environment_errors"] == 1 and two["conversation"][-1]["content"] == "twenty"
    # max_user_turns ended it
    assert three["user_turns"] == 2 and three["conversation"][-1]["content"] == "3"
    tokens = batch.response_ids[0][(batch.response_attention[0] - batch.response_mask[0]).bool()]
    # the observation is a user turn, not trained on
    assert "user\nhigher" in tokenizer.decode(tokens)
    metrics = agent_metrics(batch.records)
    assert metrics["environment/errors"] == 1 and metrics["environment/user_turns/mean"] == 5 / 3


def test_a_turn_cut_by_its_token_cap_is_closed_as_the_template_closes_it():
    """multi_turn.max_tokens_per_turn: the model's turn stops at the cap, the loop adds the turn's
    end token (context, not trained) before the environment's user turn."""
    tokenizer = build_tokenizer()
    records, _ = build_prompt_dataset(
        [{"prompt": [{"role": "user", "content": "go"}], "extra_info": {"secret": 7}}],
        tokenizer,
        max_prompt_length=64,
    )
    engine = ScriptedEngine(tokenizer, lambda text, turn: "abcdefghij")
    loop = AgentLoop(
        engine,
        tokenizer,
        [],
        AgentOptions(max_assistant_turns=2, budget=200, turn_tokens=4),
        [tokenizer.eos_token_id],
        GuessTheNumber,
    )
    loop.environment = type(
        "Talk", (GuessTheNumber,), {"step": lambda self, text: ("more", 0.0, False)}
    )
    batch = loop.generate(
        collate_prompts(records, tokenizer.pad_token_id), SamplingParams(do_sample=False)
    )
    ids, trained = batch.response_ids[0].tolist(), batch.response_mask[0].tolist()
    first = tokenizer.encode("abcdefghij", add_special_tokens=False)[:4]
    assert ids[:4] == first and trained[:5] == [1, 1, 1, 1, 0] and ids[4] == tokenizer.eos_token_id
    # two turns of 4
    assert sum(trained) == 8


def test_an_environment_that_names_no_class_with_a_step_is_refused(tmp_path, monkeypatch):
    from keel.rollout.agent.environment import load_environment

    monkeypatch.chdir(tmp_path)
    (tmp_path / "games.py").write_text(
        "class Game:\n    def step(self, text):\n        return 'ok', 0.0, True\n"
    )
    assert load_environment("games.py:Game").__name__ == "Game"
    for name in ("keel.tools.Calculator", "games.py:Nope", "nowhere.Game"):
        with pytest.raises(KeelError) as error:
            load_environment(name)
        assert error.value.code == TOOL_CONFIG and "step()" in error.value.message, name


VERL_INTERACTION = (
    """
from uuid import uuid4


class BaseInteraction:  # verl.interactions.base, as verl writes it
    def __init__(self, config):
        self.config = config
        self.name = config.get("name", "interaction_agent")

    async def finalize_interaction(self) -> None:
        pass


class Gsm8kInteraction(BaseInteraction):  # verl's example, its scorer reduced to a string compare
    def __init__(self, config):
        super().__init__(config)
        self._instance_dict = {}

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs):
        instance_id = instance_id or str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth}
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        content = next(m["content"] for m in reversed(messages) if m["role"] == "assistant")
        assert messages[0]["role"] == "user" and "question" in messages[0]["content"]  """
    """# the prompt comes first
        correct = content.strip() == self._instance_dict[instance_id]["ground_truth"]
        if correct:
            return True, "Your response is correct!", 1.0, {}
        return False, "Your response is incorrect! Try again.", 0.0, {}

    async def finalize_interaction(self, instance_id, **kwargs):
        del self._instance_dict[instance_id]


class Polite(BaseInteraction):  # the base class's finalize, which takes no instance id
    async def start_interaction(self, instance_id=None, **kwargs):
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        return False, "go on", None, {}
"""
)


def test_verls_interactions_answer_turns_and_are_finalised(tmp_path):
    """interaction_config_path in verl's format, the class from a file beside it: each episode takes
    the interaction its interaction_kwargs name; the reply is the next user turn, the score is
    recorded where verl puts it and not added (verl's agent loop adds none), termination ends the
    episode, and every instance is finalised at the end."""
    from keel.rollout.agent.interaction import InteractionEnvironment, load_interactions

    (tmp_path / "talk.py").write_text(VERL_INTERACTION)
    config = tmp_path / "interactions.yaml"
    config.write_text(
        "interaction:\n  - name: gsm8k\n    class_name: talk.py:Gsm8kInteraction\n    config: {}\n"
        "  - class_name: talk.py:Polite\n    config: {}\n"
    )
    interactions = load_interactions(config)
    # verl's default name: the class's, less "Interaction"
    assert sorted(interactions) == ["gsm8k", "polite"]
    tokenizer = build_tokenizer()
    rows = [
        {
            "prompt": [{"role": "user", "content": f"question {i}"}],
            "extra_info": {"interaction_kwargs": kwargs},
        }
        for i, kwargs in enumerate(
            [{"name": "gsm8k", "ground_truth": "72"}, {"name": "polite"}, {"name": "nobody"}]
        )
    ]
    records, _ = build_prompt_dataset(rows, tokenizer, max_prompt_length=64)
    engine = ScriptedEngine(tokenizer, lambda text, turn: ["70", "72", "71"][turn])
    loop = AgentLoop(
        engine,
        tokenizer,
        [],
        AgentOptions(max_assistant_turns=3, budget=200),
        [tokenizer.eos_token_id],
        InteractionEnvironment,
        {"interactions": interactions},
    )
    batch = loop.generate(
        collate_prompts(records, tokenizer.pad_token_id), SamplingParams(do_sample=False)
    )
    gsm8k, polite, nobody = (r.extra_info for r in batch.records)
    assert [m["content"] for m in gsm8k["conversation"]] == [
        "70",
        "Your response is incorrect! Try again.",
        "72",
    ]
    assert (
        gsm8k["turn_reward"] == 0.0
        and gsm8k["user_turns"] == 1
        and gsm8k["environment_errors"] == 0
    )
    assert gsm8k["rollout_reward_scores"] == {"user_turn_rewards": [0.0, 1.0]} and gsm8k[
        "turn_scores"
    ] == [0.0, 1.0]
    assert (
        polite["user_turns"] == 2
        and polite["turn_reward"] == 0.0
        and polite["environment_errors"] == 0
    )
    # None scores are not kept, as in verl
    assert polite["rollout_reward_scores"] == {"user_turn_rewards": []}
    # no such interaction: counted
    assert nobody["environment_errors"] == 1 and nobody["user_turns"] == 0
    # finalised
    assert interactions["gsm8k"]._instance_dict == {}


@pytest.mark.parametrize(
    "text, needle",
    [
        (None, "does not exist"),
        ("tools: []\n", "no `interaction:` list"),
        ("interaction:\n  - name: x\n", "no class_name"),
        ("interaction:\n  - class_name: nowhere.Interaction\n", "cannot be imported"),
        (
            "interaction:\n  - {name: a, class_name: talk.py:Polite}\n  - {name: a, "
            "class_name: talk.py:Polite}\n",
            "a second interaction named 'a'",
        ),
    ],
)
def test_an_interaction_config_that_does_not_build_is_refused(tmp_path, text, needle):
    from keel.rollout.agent.interaction import load_interactions

    (tmp_path / "talk.py").write_text(VERL_INTERACTION)
    config = tmp_path / "interactions.yaml"
    if text is not None:
        config.write_text(text)
    with pytest.raises(KeelError) as error:
        load_interactions(config)
    assert error.value.code == TOOL_CONFIG and needle in error.value.message
