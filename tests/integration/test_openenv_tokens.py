"""An episode on the examples' OpenEnv environment of MCP tools (its real server, in a thread)
through keel's real OpenAI endpoint, the policy's turns scripted at the engine: the model's tool
calls reach the environment as CallToolActions, the results come back as tool turns, and what is
trained is exactly the tokens sampled, with no prefix break across the tool turns."""

import asyncio
import re
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from keel.models.load import load_causal_lm, load_tokenizer
from keel.rollout.agent.external.openai_server import OpenAIEndpoint
from keel.rollout.native import NativeRolloutEngine
from keel.rollout.service import Completion, EngineService
from keel.types import SamplingParams

pytest.importorskip("openenv.core")
openai = pytest.importorskip("openai")

from test_openenv_env import serving  # noqa: E402

EXAMPLES = Path(__file__).parents[2] / "examples"
TOKEN = "s3cret"
# what a scripted turn is said to have been sampled with
LOG_PROB = -0.25


class ScriptedService:
    """The engine service, its turns written by `turn_for(context text)` instead of sampled."""

    def __init__(self, service, tokenizer, turn_for):
        self.service, self.tokenizer, self.turn_for, self.sampled = service, tokenizer, turn_for, []

    def __getattr__(self, name):
        return getattr(self.service, name)

    def submit(self, key, context, limit):
        text = self.turn_for(self.tokenizer.decode(context, skip_special_tokens=False))
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        ids = ids + [self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        self.sampled.append(ids)
        done = Future()
        done.set_result(Completion(ids, [LOG_PROB] * len(ids), stopped=True, extended=False))
        return done


def calculator_turn(context: str) -> str:
    """The model that uses the tools: add the question's numbers, then submit what add said."""
    results = re.findall(r"<\|im_start\|>tool\n(?:<tool_response>\n)?(\d+)", context)
    if results:
        call = f'{{"name": "submit", "arguments": {{"answer": {results[-1]}}}}}'
        return f"<tool_call>\n{call}\n</tool_call>"
    a, b = re.search(r"What is (\d+) \+ (\d+)\?", context).groups()
    return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


@pytest.fixture
def endpoint(tiny_assets):
    tokenizer = load_tokenizer(tiny_assets["model"])
    model = load_causal_lm(tiny_assets["model"], torch.device("cpu"))
    engine = NativeRolloutEngine(model, tokenizer, 64, torch.float32)
    service = EngineService(
        engine, SamplingParams(temperature=1.0), sequences=8, max_len=1024, turn_tokens=64
    )
    scripted = ScriptedService(service, tokenizer, calculator_turn)
    server = OpenAIEndpoint(
        scripted, tokenizer, token=TOKEN, max_request_bytes=64 << 10, max_in_flight=8
    )
    url = server.serve()
    yield server, url, scripted, tokenizer
    service.close()
    server.close()


def test_an_mcp_tool_episode_is_token_exact_through_keels_endpoint(endpoint, monkeypatch):
    from keel.rollout.agent.external.openenv_env import load_openenv_agent

    server, url, scripted, tokenizer = endpoint
    monkeypatch.syspath_prepend(str(EXAMPLES / "agent"))
    import keel_calculator_env

    with serving(keel_calculator_env.app) as base_url:
        agent = load_openenv_agent("openenv.core:MCPToolClient", {"base_url": base_url})

        async def episode():
            client = openai.AsyncOpenAI(base_url=url, api_key=TOKEN, max_retries=0)
            sample = client.with_options(default_headers={"X-Keel-Sample": "episode-1"})
            try:
                row = {"prompt": [{"role": "user", "content": "Solve it."}]}
                return await agent.run(sample, row, {})
            finally:
                await client.close()

        outcome = asyncio.run(episode())
    # add, then submit the right sum: the environment's reward, two actions
    assert outcome.status == "ok" and outcome.reward == 1.0
    assert outcome.metrics == {"openenv_steps": 2.0}
    trace = server.traces["episode-1"]
    assert trace.requests == 2 and trace.prefix_breaks == 0
    (stretch,) = trace.stretches
    trained = [t for t, keep in zip(stretch.ids, stretch.trained) if keep]
    assert trained == [t for ids in scripted.sampled for t in ids]
    text = tokenizer.decode(stretch.prompt + stretch.ids)
    # the environment's question, the add call, its result as the one tool turn, the submit call
    a, b = re.search(r"What is (\d+) \+ (\d+)\?", text).groups()
    assert text.count("<|im_start|>tool\n") == 1 and f"<|im_start|>tool\n{int(a) + int(b)}" in text
    assert text.rstrip().endswith(f'"answer": {int(a) + int(b)}}}}}\n</tool_call><|im_end|>')
