"""keel's token-level generate endpoint (`POST /inference/v1/generate`, as verifiers' TrainClient
and vLLM speak it) over the engine service on CPU: token ids in, the sampled ids and their
log-probs out; a sample's trace is exactly those tokens, a prompt that does not extend them is a
prefix break, and hostile bodies are refused with a 400 that says why."""

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

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def endpoint(tiny_assets):
    tokenizer = load_tokenizer(tiny_assets["model"])
    model = load_causal_lm(tiny_assets["model"], torch.device("cpu"))
    engine = NativeRolloutEngine(model, tokenizer, 64, torch.float32)
    service = Spy(
        EngineService(
            engine, SamplingParams(temperature=1.0), sequences=64, max_len=256, turn_tokens=16
        )
    )
    server = OpenAIEndpoint(service, tokenizer, token=TOKEN, max_request_bytes=64 << 10)
    url = server.serve()
    yield server, url, service, tokenizer
    service.service.close()
    server.close()


def generate(url: str, body: dict, token: str = TOKEN) -> httpx.Response:
    # as verifiers' renderers client builds it: the server root, not under /v1
    root = url.removesuffix("/v1")
    return httpx.post(
        f"{root}/inference/v1/generate",
        json=body,
        headers={"Authorization": f"Bearer {token}"},
        timeout=120,
    )


def test_token_turns_train_exactly_the_ids_sampled_and_keep_the_cache(endpoint):
    server, url, spy, tokenizer = endpoint
    prompt = tokenizer.encode("<|im_start|>user\ncount to three<|im_end|>\n<|im_start|>assistant\n")
    params = {"max_tokens": 8, "logprobs": 1, "temperature": 1.0, "skip_special_tokens": False}
    first = generate(url, {"model": "tokens-1", "token_ids": prompt, "sampling_params": params})
    assert first.status_code == 200, first.text
    choice = first.json()["choices"][0]
    # vLLM's shape, which verifiers' renderers client checks token by token
    assert [e["token"] for e in choice["logprobs"]["content"]] == [
        f"token_id:{t}" for t in choice["token_ids"]
    ]
    assert choice["finish_reason"] in ("stop", "length")
    # the next turn: everything so far, then the client's own tokens
    between = tokenizer.encode("<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    context = prompt + choice["token_ids"] + between
    second = generate(url, {"model": "tokens-1", "token_ids": context, "sampling_params": params})
    assert second.status_code == 200, second.text
    trace = server.traces["tokens-1"]
    assert trace.requests == 2 and trace.prefix_breaks == 0
    assert spy.extended["tokens-1"] == [False, True]
    (stretch,) = trace.stretches
    assert stretch.prompt == prompt
    sampled = [t for ids in spy.sampled["tokens-1"] for t in ids]
    assert [t for t, keep in zip(stretch.ids, stretch.trained) if keep] == sampled
    # the client's tokens between the turns: attended, not trained, never re-encoded
    assert stretch.context == context + second.json()["choices"][0]["token_ids"]
    log_probs = [
        e["logprob"] for c in (first, second) for e in c.json()["choices"][0]["logprobs"]["content"]
    ]
    assert [lp for lp, keep in zip(stretch.log_probs, stretch.trained) if keep] == pytest.approx(
        log_probs
    )


def test_a_token_prompt_that_does_not_extend_the_sample_is_a_prefix_break(endpoint):
    server, url, spy, tokenizer = endpoint
    prompt = tokenizer.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    body = {"model": "tokens-rewriter", "sampling_params": {"max_tokens": 4}}
    first = generate(url, {**body, "token_ids": prompt}).json()["choices"][0]
    # the client rewrites the first sampled token
    edited = [t for t in tokenizer.encode("edited ok") if t != first["token_ids"][0]][:1]
    rewritten = prompt + edited + first["token_ids"][1:] + tokenizer.encode("again")
    assert generate(url, {**body, "token_ids": rewritten}).status_code == 200
    trace = server.traces["tokens-rewriter"]
    assert trace.prefix_breaks == 1 and len(trace.stretches) == 2
    second = trace.stretches[1]
    assert second.prompt == rewritten
    assert [t for t, keep in zip(second.ids, second.trained) if keep] == spy.sampled[
        "tokens-rewriter"
    ][1]


@pytest.mark.parametrize(
    "body, said",
    [
        ({"token_ids": "hello"}, "list of whole numbers"),
        ({"token_ids": []}, "non-empty"),
        ({"token_ids": [1, True]}, "list of whole numbers"),
        ({"token_ids": [1, 2.5]}, "list of whole numbers"),
        ({"token_ids": [1, -1]}, "outside the vocabulary"),
        ({"token_ids": [1, 10**9]}, "outside the vocabulary"),
        ({"token_ids": [1] * 300}, "the rollout's context is 256"),
        ({"token_ids": [1], "prompt": "x"}, "unknown keys ['prompt']"),
        ({"token_ids": [1], "sampling_params": [1]}, "sampling_params must be an object"),
        ({"token_ids": [1], "sampling_params": {"max_tokens": 10_000}}, "from 1 to the rollout's"),
        ({"token_ids": [1], "sampling_params": {"max_tokens": "8"}}, "from 1 to the rollout's"),
        ({"token_ids": [1], "sampling_params": {"temperature": 0.1}}, "differs from the rollout"),
        ({"token_ids": [1], "sampling_params": {"n": 2}}, "n must be 1"),
        ({"token_ids": [1], "sampling_params": {"seed": 3}}, "samples without it"),
        ({"token_ids": [1], "sampling_params": {"logprobs": 5}}, "logprobs must be 0 or 1"),
        ({"token_ids": [1], "sampling_params": {"stop_token_ids": [5]}}, "stop tokens"),
        ({"token_ids": [1], "sampling_params": {"beam_width": 4}}, "not ones keel's engine"),
    ],
)
def test_hostile_generate_bodies_are_refused_with_the_reason(endpoint, body, said):
    _, url, _, tokenizer = endpoint
    refused = generate(url, {"model": "tokens-hostile", **body})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == AGENT_REQUEST and said in error["message"]
    # the fix: ids of the vocabulary, the rollout's own settings; the engine still serves
    fixed = {"model": "tokens-fixed", "token_ids": tokenizer.encode("hi")}
    assert generate(url, {**fixed, "sampling_params": {"max_tokens": 2}}).status_code == 200


def test_generate_wants_the_token_and_a_budget_bounds_its_turns(endpoint):
    _, url, spy, tokenizer = endpoint
    body = {"model": "tokens-auth", "token_ids": tokenizer.encode("hi")}
    assert generate(url, body, token="wrong").status_code == 401
    budgeted = OpenAIEndpoint(spy, tokenizer, token=TOKEN, budget=12)
    budget_url = budgeted.serve()
    try:
        body = {"model": "tokens-budget", "sampling_params": {"max_tokens": 8}}
        prompt = tokenizer.encode("count")
        ids = generate(budget_url, {**body, "token_ids": prompt}).json()["choices"][0]["token_ids"]
        context = prompt + ids + tokenizer.encode(" more" * 12)
        spent = generate(budget_url, {**body, "token_ids": context})
        # what clients read as a rollout at its length
        assert spent.status_code == 400 and spent.json()["error"]["type"] == (
            "context_length_exceeded"
        )
        assert budgeted.traces["tokens-budget"].budget_spent
    finally:
        budgeted.close()


def test_ids_past_the_tokenizers_are_taken_back_only_where_the_engine_sampled_them(endpoint):
    from keel.rollout.agent.external.generate_requests import GenerateReader, RequestError
    from keel.rollout.agent.external.trace import Trace

    _, _, spy, tokenizer = endpoint
    vocab = len(tokenizer)
    reader = GenerateReader(spy, vocab)
    trace = Trace()
    # a model's embedding may have rows past its tokenizer's ids, and the engine samples them
    trace.record([1, 2], [vocab + 2], [-0.5], stopped=False)
    prompt, _ = reader.prompt({"token_ids": [1, 2, vocab + 2, 5]}, trace)
    assert prompt == [1, 2, vocab + 2, 5]
    with pytest.raises(RequestError, match="did not sample"):
        reader.prompt({"token_ids": [1, 2, vocab + 3]}, trace)


def test_settings_that_change_no_token_are_taken(endpoint):
    """What verifiers' TrainClient and vLLM clients send beside the sampling settings: where a
    bridged turn's prompt starts (MoE routing replay), no stop ids, no stop strings."""
    _, url, _, tokenizer = endpoint
    params = {
        "max_tokens": 2,
        "routed_experts_prompt_start": 3,
        "stop_token_ids": None,
        "stop": [],
        "skip_special_tokens": False,
    }
    body = {"model": "tokens-neutral", "token_ids": tokenizer.encode("hi")}
    answered = generate(url, {**body, "sampling_params": params})
    assert answered.status_code == 200, answered.text
    assert generate(url, {**body, "sampling_params": {"stop": ["x"]}}).status_code == 400


def test_a_prompt_at_the_rollouts_context_reads_as_a_rollout_at_its_length(endpoint):
    server, url, _, _ = endpoint
    refused = generate(url, {"model": "tokens-long", "token_ids": [1] * 256})
    assert refused.status_code == 400
    assert refused.json()["error"]["type"] == "context_length_exceeded"
    assert server.traces["tokens-long"].budget_spent


def test_json_nested_past_the_parsers_limit_is_refused(endpoint):
    _, url, _, _ = endpoint
    root = url.removesuffix("/v1")
    deep = b"[" * 30_000 + b"]" * 30_000
    refused = httpx.post(
        f"{root}/inference/v1/generate",
        content=deep,
        headers={"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"},
        timeout=120,
    )
    assert refused.status_code == 400 and "nested too deeply" in refused.json()["error"]["message"]
