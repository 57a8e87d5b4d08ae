"""keel's OpenAI-compatible endpoint over the engine service, driven by the real `openai` client on
CPU: the tokens a sample trains on are the tokens the engine sampled, a conversation that continues
keeps its KV cache, a rewritten history is counted, and hostile requests are refused."""

import json

import httpx
import pytest
import torch

from keel.errors import AGENT_REQUEST
from keel.models.load import load_causal_lm, load_tokenizer
from keel.rollout.agent.external.openai_server import OpenAIEndpoint
from keel.rollout.native import NativeRolloutEngine
from keel.rollout.service import EngineService
from keel.types import SamplingParams

from tests_helpers import Spy

openai = pytest.importorskip("openai")

TOKEN = "s3cret"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "evaluates arithmetic",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def endpoint(tiny_assets):
    tokenizer = load_tokenizer(tiny_assets["model"])
    model = load_causal_lm(tiny_assets["model"], torch.device("cpu"))
    engine = NativeRolloutEngine(model, tokenizer, 64, torch.float32)
    # a row for every sample the module's tests name: none of them is ended, so each keeps its row
    service = Spy(
        EngineService(
            engine, SamplingParams(temperature=1.0), sequences=64, max_len=512, turn_tokens=16
        )
    )
    server = OpenAIEndpoint(
        service, tokenizer, token=TOKEN, max_request_bytes=64 << 10, max_in_flight=8
    )
    url = server.serve()
    yield server, url, service, tokenizer
    # first: a request still waiting is answered, so the server can stop
    service.service.close()
    server.close()


def client(url, token=TOKEN):
    return openai.OpenAI(base_url=url, api_key=token, max_retries=0, timeout=120)


def test_a_multi_turn_tool_episode_trains_exactly_the_sampled_tokens(endpoint):
    server, url, spy, tokenizer = endpoint
    chat = client(url).chat.completions
    messages = [{"role": "user", "content": "What is 12*34? Use the calculator."}]
    for turn in range(3):
        reply = chat.create(model="episode-1", messages=messages, tools=TOOLS, max_tokens=16)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        messages.append(
            {"role": "tool", "tool_call_id": f"call-{turn}", "content": str(408 + turn)}
        )
    trace = server.traces["episode-1"]
    assert trace.requests == 3 and trace.prefix_breaks == 0
    # the cache was kept across turns
    assert spy.extended["episode-1"] == [False, True, True]
    (stretch,) = trace.stretches
    trained = [t for t, keep in zip(stretch.ids, stretch.trained) if keep]
    assert trained == [t for ids in spy.sampled["episode-1"] for t in ids]
    # between the turns: exactly what the template puts after the model's stop token, never
    # re-encoded answers
    text = tokenizer.decode(stretch.prompt + stretch.ids)
    assert text.count("<|im_start|>tool\n") == 2 and text.startswith(
        "<|im_start|>user\nWhat is 12*34?"
    )
    assert all(lp <= 0 for lp in stretch.log_probs) and any(lp < 0 for lp in stretch.log_probs)


def test_a_client_that_rewrites_the_history_is_counted_and_never_trained_as_sampled(endpoint):
    server, url, spy, _ = endpoint
    chat = client(url).chat.completions
    messages = [{"role": "user", "content": "hello"}]
    first = chat.create(model="rewriter", messages=messages, max_tokens=8).choices[0].message
    messages += [
        {"role": "assistant", "content": first.content + " (edited)"},
        {"role": "user", "content": "again"},
    ]
    chat.create(model="rewriter", messages=messages, max_tokens=8)
    trace = server.traces["rewriter"]
    assert trace.prefix_breaks == 1 and spy.extended["rewriter"] == [False, False]
    second = trace.stretches[1]
    assert [t for t, keep in zip(second.ids, second.trained) if keep] == spy.sampled["rewriter"][1]
    assert not any(second.trained[: len(second.ids) - len(spy.sampled["rewriter"][1])])


def test_streamed_and_plain_completions(endpoint):
    server, url, spy, tokenizer = endpoint
    api = client(url)
    hi = [{"role": "user", "content": "hi"}]
    chunks = list(api.chat.completions.create(model="streamed", messages=hi, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == tokenizer.decode(spy.sampled["streamed"][0], skip_special_tokens=True)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    text = api.completions.create(model="plain", prompt="1 + 1 =", max_tokens=5)
    assert text.usage.completion_tokens == len(spy.sampled["plain"][0]) <= 5
    assert server.traces["plain"].stretches[0].prompt == tokenizer.encode(
        "1 + 1 =", add_special_tokens=False
    )


def test_tool_calls_come_back_in_openais_form(endpoint):
    server, _, _, _ = endpoint

    class Done:
        ids = [1, 2]
        stopped = True

    server.tokenizer = type("T", (), {"decode": lambda self, ids, **_: CALL_TEXT})()
    try:
        answer = server._answer(Done, chat=True)
    finally:
        server.tokenizer = endpoint[3]
    assert (
        answer["finish_reason"] == "tool_calls"
        and answer["message"]["content"] == "Let me compute."
    )
    (call,) = answer["message"]["tool_calls"]
    assert call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "12*34"}


CALL_TEXT = (
    'Let me compute.<tool_call>{"name": "calculator", "arguments": {"expression": '
    '"12*34"}}</tool_call>'
)


@pytest.mark.parametrize(
    "request_body, status",
    [
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 0.2}, 400),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10_000}, 400),
        ({"messages": "not a list"}, 400),
        ({"messages": [{"role": "user", "content": "x" * (80 << 10)}]}, 413),
    ],
)
def test_requests_the_engine_cannot_serve_are_refused_with_the_code(endpoint, request_body, status):
    _, url, _, _ = endpoint

    def send(body):
        headers = {"Authorization": f"Bearer {TOKEN}"}
        return httpx.post(
            f"{url}/chat/completions",
            json={"model": "refused", **body},
            headers=headers,
            timeout=60,
        )

    response = send(request_body)
    assert response.status_code == status
    assert response.json()["error"]["code"] == AGENT_REQUEST
    # the fix: the rollout's own settings (unset), one choice, a budget within the rollout's, a real
    # conversation
    assert (
        send({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}).status_code == 200
    )


def test_the_endpoint_wants_its_token_and_survives_garbage_and_hang_ups(endpoint):
    _, url, spy, _ = endpoint
    with pytest.raises(openai.AuthenticationError):
        client(url, token="wrong").models.list()
    garbage = httpx.post(
        f"{url}/completions", content=b"\xff{", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert garbage.status_code == 400
    token_ids = httpx.post(
        f"{url}/completions",
        json={"model": "ids", "prompt": [10**9]},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
    )
    # a token id outside the vocabulary never reaches the engine
    assert token_ids.status_code == 400
    body = {"model": "hangup", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream(
        "POST",
        f"{url}/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
    ) as response:
        # the client goes away before reading a byte
        assert response.status_code == 200
    after = client(url).chat.completions.create(
        model="after", messages=[{"role": "user", "content": "still up?"}]
    )
    assert after.choices[0].message.content is not None and spy.sampled["after"]


def test_a_samples_budget_bounds_its_turns_and_then_refuses(endpoint):
    _, _, spy, tokenizer = endpoint
    budgeted = OpenAIEndpoint(spy, tokenizer, token=TOKEN, budget=56)
    url = budgeted.serve()
    try:
        chat = client(url).chat.completions
        messages = [{"role": "user", "content": "count"}]
        first = chat.create(model="budgeted", messages=messages, max_tokens=16).choices[0].message
        messages += [first.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        second = chat.create(model="budgeted", messages=messages, max_tokens=16)
        stretch = budgeted.traces["budgeted"].stretches[0]
        # cut to what the budget left
        assert len(stretch.ids) <= 56 and second.usage.completion_tokens < 16
        messages += [
            second.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "more"},
        ]
        with pytest.raises(openai.BadRequestError, match="budget") as spent:
            chat.create(model="budgeted", messages=messages, max_tokens=16)
        assert budgeted.traces["budgeted"].budget_spent
        # what clients read as a rollout at its length
        assert spent.value.type == "context_length_exceeded"
    finally:
        budgeted.close()


@pytest.mark.parametrize(
    "path, body",
    [
        # no token to start from: once, this stopped the engine for everyone
        ("completions", {"prompt": ""}),
        ("completions", {"prompt": "x", "max_tokens": 0}),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi", "tool_calls": 1}]}),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "hi", "tool_calls": [{"function": "x"}]}]},
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
        ),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": "x"}),
    ],
)
def test_hostile_shapes_are_answered_and_the_engine_keeps_serving(endpoint, path, body):
    _, url, _, _ = endpoint
    headers = {"Authorization": f"Bearer {TOKEN}"}
    response = httpx.post(
        f"{url}/{path}", json={"model": f"hostile-{path}", **body}, headers=headers, timeout=60
    )
    assert response.status_code in (200, 400), response.text
    after = client(url).completions.create(
        model=f"after-{len(str(body))}", prompt="still up?", max_tokens=2
    )
    assert after.choices[0].finish_reason in ("stop", "length")


def test_a_completion_prompt_of_bools_is_no_token_ids(endpoint):
    _, url, _, _ = endpoint
    response = httpx.post(
        f"{url}/completions",
        json={"model": "bool-prompt", "prompt": [1, True, False], "max_tokens": 2},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
    )
    assert response.status_code == 400 and "list of token ids" in response.text
