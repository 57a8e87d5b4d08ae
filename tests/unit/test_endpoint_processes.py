"""keel's OpenAI endpoint in processes of its own: the real `openai` client talks to two endpoint
processes, the engine service runs in this one, and what each sample trains on is still exactly
what the engine sampled, its trace collected whole from the process that served it. An endpoint
process that dies mid-rollout, or cannot start, is said, never a hang."""

import os

import pytest
import torch

from keel.errors import AGENT_FUNCTION, KeelError
from keel.models.load import load_causal_lm, load_tokenizer
from keel.rollout.agent.external.endpoints import EndpointProcesses
from keel.rollout.native import NativeRolloutEngine
from keel.rollout.service import EngineService
from keel.types import SamplingParams

openai = pytest.importorskip("openai")

TOKEN = "s3cret"


class Spy:
    """The engine service, recording every completion it hands out (in this, the engine's,
    process)."""

    def __init__(self, service):
        self.service, self.sampled = service, {}

    def __getattr__(self, name):
        return getattr(self.service, name)

    def submit(self, key, context, limit):
        future = self.service.submit(key, context, limit)
        future.add_done_callback(
            lambda done: (
                done.exception() or self.sampled.setdefault(key, []).append(done.result().ids)
            )
        )
        return future


@pytest.fixture(scope="module")
def engine(tiny_assets):
    tokenizer = load_tokenizer(tiny_assets["model"])
    model = load_causal_lm(tiny_assets["model"], torch.device("cpu"))
    return NativeRolloutEngine(model, tokenizer, 64, torch.float32), tokenizer


def spy_service(engine):
    return Spy(
        EngineService(
            engine, SamplingParams(temperature=1.0), sequences=8, max_len=512, turn_tokens=16
        )
    )


def episode(url: str, sample: str, turns: int = 2, rewrite: bool = False) -> None:
    chat = openai.OpenAI(base_url=url, api_key=TOKEN, max_retries=0, timeout=120).chat.completions
    messages = [{"role": "user", "content": f"count for {sample}"}]
    for _ in range(turns):
        reply = chat.create(model=sample, messages=messages, max_tokens=6).choices[0].message
        messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
        if rewrite:
            messages[0] = {"role": "user", "content": "a different question"}


def sampled_in(trace) -> list[int]:
    return [t for s in trace.stretches for t, keep in zip(s.ids, s.trained) if keep]


def test_two_endpoint_processes_serve_a_rollout_token_exact_then_the_next(engine):
    model, tokenizer = engine
    endpoints = EndpointProcesses(tokenizer, 2, "127.0.0.1", TOKEN, max_in_flight=8)
    try:
        assert len(set(endpoints.urls)) == 2 and all(
            p.pid != os.getpid() for p in endpoints.processes
        )
        # before any rollout: refused, not a server error
        with pytest.raises(openai.APIStatusError) as early:
            episode(endpoints.urls[0], "early")
        assert early.value.status_code in (400, 503)
        service = spy_service(model)
        first, second = endpoints.begin(service, budget=400)
        episode(first, "a", turns=3)
        episode(second, "b", turns=2)
        episode(second, "c", turns=2, rewrite=True)
        service.close()
        traces = endpoints.collect()
        assert sorted(traces) == ["a", "b", "c"]
        assert [traces[k].requests for k in "abc"] == [3, 2, 2]
        assert traces["a"].prefix_breaks == 0 and traces["c"].prefix_breaks == 1
        # crossed a process boundary both ways: still exactly the engine's tokens
        for key in "abc":
            assert sampled_in(traces[key]) == [t for ids in service.sampled[key] for t in ids]
        # the rollout is over: refused, not queued
        with pytest.raises(openai.APIStatusError) as over:
            episode(first, "late")
        assert over.value.status_code == 503

        # the next rollout: the same processes, fresh traces
        service = spy_service(model)
        (url, _) = endpoints.begin(service, budget=400)
        episode(url, "d", turns=1)
        service.close()
        assert list(endpoints.collect()) == ["d"]
    finally:
        endpoints.close()
    assert not any(p.is_alive() for p in endpoints.processes)


def test_a_dead_or_unstartable_endpoint_process_is_said(engine):
    model, tokenizer = engine
    endpoints = EndpointProcesses(tokenizer, 2, "127.0.0.1", TOKEN, max_in_flight=8)
    try:
        service = spy_service(model)
        first, second = endpoints.begin(service, budget=400)
        episode(first, "a", turns=1)
        episode(second, "b", turns=1)
        endpoints.processes[1].kill()
        endpoints.processes[1].join()
        service.close()
        with pytest.raises(KeelError) as broke:
            endpoints.collect()
        assert broke.value.code == AGENT_FUNCTION and "keel-endpoint-1" in str(broke.value)
        # the other was asked too, and lives
        assert endpoints.bridges == [] and not endpoints.processes[0].exitcode
    finally:
        endpoints.close()
    with pytest.raises(KeelError) as unstartable:
        # an address this machine lacks
        EndpointProcesses(tokenizer, 1, "192.0.2.1", TOKEN, max_in_flight=8)
    assert unstartable.value.code == AGENT_FUNCTION and "could not" in str(unstartable.value)
