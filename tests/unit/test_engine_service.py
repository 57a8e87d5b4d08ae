"""The engine as a service: turns submitted from many threads at once are batched by one run loop,
answer as the engine's own generate would, keep a key's cache while its context extends, and wait
for a row (never fail) when every row is taken."""

import threading

import pytest
import torch

from keel.data.prompts import build_prompt_dataset, collate_prompts
from keel.models.load import load_causal_lm, load_tokenizer
from keel.rollout.native import NativeRolloutEngine
from keel.rollout.service import EngineService
from keel.types import SamplingParams

GREEDY = SamplingParams(do_sample=False, max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_assets):
    tokenizer = load_tokenizer(tiny_assets["model"])
    model = load_causal_lm(tiny_assets["model"], torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    # matrices redrawn large enough that greedy decoding does not repeat one token
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return NativeRolloutEngine(model, tokenizer, 8, torch.float32), tokenizer


def prompt_ids(tokenizer, texts):
    records, _ = build_prompt_dataset(
        [{"prompt": t} for t in texts], tokenizer, max_prompt_length=48
    )
    return collate_prompts(records, tokenizer.pad_token_id)


def test_turns_from_many_threads_answer_as_generate_does(engine):
    engine, tokenizer = engine
    prompts = prompt_ids(tokenizer, ["one", "two two", "three three three", "four"])
    expected = engine.generate(prompts, GREEDY).response_ids.tolist()
    service = EngineService(engine, GREEDY, sequences=4, max_len=64, turn_tokens=6)
    try:
        contexts = [
            ids[mask.bool()].tolist()
            for ids, mask in zip(prompts.input_ids, prompts.attention_mask)
        ]
        results = [None] * 4
        threads = [
            threading.Thread(
                target=lambda i=i: results.__setitem__(
                    i, service.submit(i, contexts[i], 6).result()
                )
            )
            for i in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        service.close()
    assert [r.ids for r in results] == expected
    assert not any(r.extended or r.stopped for r in results)


def test_a_key_keeps_its_cache_while_its_context_extends(engine):
    engine, tokenizer = engine
    service = EngineService(engine, GREEDY, sequences=2, max_len=64, turn_tokens=6)
    try:
        first = service.submit("a", [5, 6, 7], 6).result()
        extended = service.submit("a", [5, 6, 7] + first.ids + [9, 9], 6).result()
        rewritten = service.submit("a", [5, 6, 8] + first.ids + [9, 9], 6).result()
        fresh = service.submit("b", [5, 6, 7] + first.ids + [9, 9], 6).result()
    finally:
        service.close()
    assert extended.extended and not rewritten.extended
    # reusing the cache changes nothing of the answer
    assert extended.ids == fresh.ids


def test_a_key_waits_for_a_row_until_another_ends(engine):
    engine, _ = engine
    service = EngineService(engine, GREEDY, sequences=1, max_len=64, turn_tokens=6)
    try:
        service.submit("first", [5, 6, 7], 6).result()
        waiting = service.submit("second", [8, 9], 6)
        # its row is held by "first", whose episode may go on
        assert not waiting.done()
        service.end("first")
        assert len(waiting.result(timeout=300).ids) == 6
    finally:
        service.close()


def test_refusals_and_closing_never_hang_a_caller(engine):
    engine, _ = engine
    service = EngineService(engine, GREEDY, sequences=1, max_len=16, turn_tokens=6)
    with pytest.raises(ValueError, match="exceed"):
        service.submit("long", list(range(5, 20)), 6).result()
    done = service.submit("a", [5, 6], 6).result()
    with pytest.raises(ValueError, match="no new tokens"):
        service.submit("a", [5, 6] + done.ids, 6).result()
    # no row: "a" holds the only one
    stuck = service.submit("b", [5, 6], 6)
    service.close()
    with pytest.raises(RuntimeError, match="closed"):
        stuck.result(timeout=300)


def test_a_turn_after_its_key_ended_is_refused_and_keeps_no_row(engine):
    """An agent cut by its timeout ends its key while its last request may still be on the way:
    that request must not take a row nobody will free."""
    engine, _ = engine
    service = EngineService(engine, GREEDY, sequences=1, max_len=64, turn_tokens=6)
    try:
        service.end("late")
        with pytest.raises(ValueError, match="was ended"):
            service.submit("late", [5, 6, 7], 6).result(timeout=300)
        # the only row is free
        assert len(service.submit("next", [8, 9], 6).result(timeout=300).ids) == 6
    finally:
        service.close()


def test_turns_arriving_within_the_admission_window_share_one_prefill(engine):
    """Held while arrivals keep coming, then admitted together: one prefill pass for all of them,
    and the same answers as turns admitted one by one. A close while turns are held answers them."""
    engine, tokenizer = engine
    prompts = prompt_ids(tokenizer, [f"turn {'x ' * i}" for i in range(6)])
    contexts = [
        ids[mask.bool()].tolist() for ids, mask in zip(prompts.input_ids, prompts.attention_mask)
    ]

    def answers(admission_s: float) -> tuple[list, int]:
        service = EngineService(
            engine, GREEDY, sequences=6, max_len=64, turn_tokens=6, admission_s=admission_s
        )
        passes, prefill = [], service.batcher.decoding.runner.prefill
        service.batcher.decoding.runner.prefill = lambda *a, **k: (
            passes.append(1) or prefill(*a, **k)
        )
        try:
            # within the window
            futures = [service.submit(i, context, 6) for i, context in enumerate(contexts)]
            return [f.result(timeout=600).ids for f in futures], len(passes)
        finally:
            service.close()

    held, passes = answers(admission_s=5.0)
    assert passes == 1
    assert held == answers(admission_s=0.0)[0]
    service = EngineService(
        engine, GREEDY, sequences=6, max_len=64, turn_tokens=6, admission_s=600.0
    )
    waiting = service.submit("held", contexts[0], 6)
    service.close()
    with pytest.raises(RuntimeError, match="closed"):
        waiting.result(timeout=600)


def test_turns_submitted_together_share_a_pass_and_are_told_on_one_queue(engine):
    """keel's agent loop as a client: its turns go in together (one prefill pass, a prompt's group
    sharing its prefill), the turns a step ends come back in one message on its queue, a refused
    turn is told there too, and a closing service says so there: the client never waits on
    nothing."""
    import queue

    engine, tokenizer = engine
    prompts = prompt_ids(tokenizer, ["one", "two two", "three three three", "four"])
    contexts = [
        ids[mask.bool()].tolist() for ids, mask in zip(prompts.input_ids, prompts.attention_mask)
    ]
    expected = engine.generate(prompts, GREEDY).response_ids.tolist()
    service = EngineService(engine, GREEDY, sequences=4, max_len=64, turn_tokens=6)
    news: queue.Queue = queue.Queue()
    try:
        service.submit_many([(i, contexts[i], 6, i) for i in range(4)], notify=news)
        kind, answered = news.get(timeout=120)
        # one step ended all four
        assert kind == "turns" and sorted(key for key, _ in answered) == [0, 1, 2, 3]
        assert [
            future.result().ids for _, future in sorted(answered, key=lambda a: a[0])
        ] == expected
        assert service.stats["admissions"] == 1 and service.stats["turns"] == 4
        (refused,) = service.submit_many([("big", contexts[0], 7, None)], notify=news)
        kind, told = news.get(timeout=120)
        assert (
            kind == "turns"
            and told == [("big", refused)]
            and isinstance(refused.exception(), ValueError)
        )
    finally:
        service.close()
    assert news.get(timeout=120)[0] == "closed"


def test_keys_of_one_group_share_their_first_prefill(engine):
    """An HTTP endpoint's turns carry no group; the service is told each key's (the sample's prompt)
    and prefills one copy of a context that several keys of a group start with."""
    engine, tokenizer = engine
    prompts = prompt_ids(tokenizer, ["the same prompt", "another one"])
    same, other = [
        ids[mask.bool()].tolist() for ids, mask in zip(prompts.input_ids, prompts.attention_mask)
    ]
    groups = {"a": 0, "b": 0, "c": 0, "d": 1}
    service = EngineService(engine, GREEDY, sequences=4, max_len=64, turn_tokens=6, groups=groups)
    try:
        futures = service.submit_many(
            [
                ("a", same, 6, None),
                ("b", same, 6, None),
                ("c", same, 6, None),
                ("d", other, 6, None),
            ]
        )
        answers = [f.result(timeout=120).ids for f in futures]
        # an earlier rollout's, say
        with pytest.raises(ValueError, match="not a sample of this rollout"):
            service.submit("sample-of-yesterday", same, 6).result(timeout=120)
    finally:
        service.close()
    # a, b and c: one prefill of their prompt
    assert service.batcher.decoding.prefilled == len(same) + len(other)
    # greedy from the same cache
    assert answers[0] == answers[1] == answers[2]
