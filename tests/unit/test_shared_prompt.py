"""A micro-batch's samples of one prompt computed with the prompt once (training/shared_prompt.py):
the log-probs, entropies and gradients of every sample's own [prompt | response] pass, with
prompts left-padded to different lengths, responses of different lengths, and a sample alone with
its prompt; the layout's blocks and mask; and when it does not apply."""

import dataclasses

import pytest
import torch

from keel.models.load import load_causal_lm
from keel.training import forward, shared_prompt
from keel.training.shared_prompt import PADDING, PROMPT, shared_prompts

from tests_helpers import padded_batch


def _grouped_batch(vocab: int):
    """Prompts a (3 samples), b (2 samples), c (1 sample): left-padded to 5, responses 1-6."""
    batch = padded_batch(vocab, [4, 2, 5, 4, 2, 4], [6, 3, 5, 1, 6, 4], seed=3, low=3)
    prompts = batch.prompt_ids.clone()
    prompts[3], prompts[5], prompts[4] = prompts[0], prompts[0], prompts[1]
    group_index = torch.tensor([0, 1, 2, 0, 1, 0])
    return dataclasses.replace(batch, prompt_ids=prompts, group_index=group_index)


def _stats_and_gradients(model, batch, share: bool, monkeypatch):
    monkeypatch.setattr(shared_prompt, "SHARE_PROMPTS", share)
    model.zero_grad(set_to_none=True)
    log_probs, entropy = forward.response_log_probs(model, batch, 0.8, with_entropy=True)
    mask = batch.response_mask.bool()
    (log_probs * mask).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return log_probs * mask, entropy * mask, grads


def test_shared_prompts_give_each_samples_own_log_probs_and_gradients(tiny_assets, monkeypatch):
    model = load_causal_lm(tiny_assets["model"], torch.device("cpu"))
    batch = _grouped_batch(model.config.vocab_size)
    assert shared_prompts(batch.input_ids, batch.attention_mask, 6) is not None
    own = _stats_and_gradients(model, batch, False, monkeypatch)
    shared = _stats_and_gradients(model, batch, True, monkeypatch)
    torch.testing.assert_close(shared[0], own[0], rtol=0, atol=2e-5)
    torch.testing.assert_close(shared[1], own[1], rtol=0, atol=2e-5)
    for ours, theirs in zip(shared[2], own[2]):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)
    assert own[0].abs().sum() > 0 and any(g.abs().sum() > 0 for g in own[2])


def test_the_blocks_hold_each_prompt_once_and_each_response_after_it():
    batch = _grouped_batch(50)
    shared = shared_prompts(batch.input_ids, batch.attention_mask, 6)
    # blocks in order of first appearance: a (samples 0, 3, 5), b (1, 4), c (2)
    lengths = [4 + 6 + 1 + 4, 2 + 3 + 6, 5 + 5]
    assert shared.input_ids.shape == (3, max(lengths))
    assert [int((row != PADDING).sum()) for row in shared.segments] == lengths
    first = shared.segments[0, : lengths[0]].tolist()
    assert first == [PROMPT] * 4 + [0] * 6 + [1] * 1 + [2] * 4
    # the second response of a starts again at the position after the prompt
    assert shared.position_ids[0, 10].item() == 4 and shared.position_ids[0, 11].item() == 4
    assert shared.input_ids[0, :4].tolist() == batch.prompt_ids[0, 1:].tolist()
    # every real response token is a target once, read at the position before it
    assert len(shared.targets) == int(batch.response_mask.sum())
    flat = batch.response_ids.reshape(-1)
    assert torch.equal(shared.targets, flat[shared.scatter_to])


def test_a_response_sees_its_prompt_and_itself_never_another():
    batch = _grouped_batch(50)
    shared = shared_prompts(batch.input_ids, batch.attention_mask, 6)
    mask = shared.mask(flex=False)[0, 0]  # block a: prompt 0-3, responses 4-9, 10, 11-14
    assert mask[3, :4].all() and not mask[2, 3]  # the prompt is causal
    assert mask[10, :4].all() and mask[10, 10] and not mask[10, 4:10].any()
    assert mask[12, 11:13].all() and not mask[12, 13] and not mask[12, 4:11].any()
    # block c (10 tokens) is padded to 15: padding sees only itself, and nothing sees it
    padded = shared.mask(flex=False)[2, 0]
    assert padded[12, 12] and padded[12].sum() == 1 and not padded[:10, 10:].any()


def test_nothing_is_shared_without_a_repeated_prompt_or_with_an_empty_one():
    distinct = padded_batch(50, [4, 2, 5], [6, 3, 5], seed=1, low=3)
    assert shared_prompts(distinct.input_ids, distinct.attention_mask, 6) is None
    empty = padded_batch(50, [0, 0], [3, 2], seed=1, low=3)
    assert shared_prompts(empty.input_ids, empty.attention_mask, 3) is None


@pytest.mark.parametrize("implementation", ["flash_attention_2", "eager"])
def test_a_model_on_another_attention_keeps_each_samples_own_pass(
    tiny_assets, monkeypatch, implementation
):
    """The mask means what it says to SDPA and flex attention only: a model loaded with another
    attention computes each sample whole, as before."""
    monkeypatch.setattr(shared_prompt, "SHARE_PROMPTS", True)
    model = load_causal_lm(tiny_assets["model"], torch.device("cpu"))
    batch = _grouped_batch(model.config.vocab_size)
    model.config._attn_implementation = implementation
    assert shared_prompt.shared_prompts_of(batch, model.config) is None


def test_flex_attentions_block_mask_gives_the_dense_masks_log_probs(tiny_assets):
    """The GPU's path, flex attention with the block mask, forward only (the CPU's flex attention
    has no backward): the log-probs of the dense mask's pass through SDPA."""
    from functools import partial

    model = load_causal_lm(tiny_assets["model"], torch.device("cpu"))
    batch = _grouped_batch(model.config.vocab_size)
    shared = shared_prompts(batch.input_ids, batch.attention_mask, 6)
    stats = partial(forward.decoder_token_stats, model)
    with torch.no_grad():
        dense, _, _ = shared_prompt.shared_prompt_stats(
            stats, shared, model.config, 0.8, False, False, flex=False
        )
        flex, _, _ = shared_prompt.shared_prompt_stats(
            stats, shared, model.config, 0.8, False, False, flex=True
        )
    assert model.config._attn_implementation == "sdpa"
    mask = batch.response_mask.bool()
    torch.testing.assert_close(flex * mask, dense * mask, rtol=0, atol=1e-5)
    assert (dense * mask).abs().sum() > 0


def test_micro_batches_keep_a_prompts_samples_together_when_sharing(monkeypatch):
    """Shortest first would spread a prompt's samples over micro-batches; sharing keeps them in
    one, so each computes its prompt once."""
    from keel.training.batching import MicroBatching, micro_batches

    batch = _grouped_batch(50)
    # prompt a: samples 0, 3, 5 (tokens 10, 5, 8); b: 1, 4 (5, 8); c: 2 (10). Each sample is its
    # own group here (a prompt drawn several times): a prompt is shared by its tokens
    batch = dataclasses.replace(batch, group_index=torch.arange(6))
    monkeypatch.setattr(shared_prompt, "SHARE_PROMPTS", True)
    together = [rows.tolist() for rows, _ in micro_batches(batch, MicroBatching(2))]
    # prompts by their longest sample: b (8), then a and c (10)
    assert together == [[1, 4], [3, 5], [0, 2]]
    monkeypatch.setattr(shared_prompt, "SHARE_PROMPTS", False)
    by_length = [rows.tolist() for rows, _ in micro_batches(batch, MicroBatching(2))]
    assert by_length == [[1, 3], [4, 5], [0, 2]]


def test_the_old_log_prob_pass_gives_the_same_log_probs_shared(tiny_assets, monkeypatch):
    from keel.training.batching import MicroBatching

    model = load_causal_lm(tiny_assets["model"], torch.device("cpu"))
    batch = _grouped_batch(model.config.vocab_size)
    passes = {}
    for share in (False, True):
        monkeypatch.setattr(shared_prompt, "SHARE_PROMPTS", share)
        passes[share] = forward.batched_log_probs(model, batch, MicroBatching(4), 1.0)
    torch.testing.assert_close(passes[True], passes[False], rtol=0, atol=2e-5)
    assert passes[False].abs().sum() > 0


def test_distillations_top_k_and_given_ids_come_back_as_each_samples_own(tiny_assets, monkeypatch):
    """What distillation asks of each position's distribution: its k most likely tokens (the
    teacher's pass) and the log-probs of given ids (the student's), at every real response
    position."""
    model = load_causal_lm(tiny_assets["model"], torch.device("cpu"))
    batch = _grouped_batch(model.config.vocab_size)
    real = batch.response_mask.bool()
    ids = torch.randint(0, model.config.vocab_size, (*batch.response_ids.shape, 3))
    for extra in (forward.TopK(4), ids):
        results = {}
        for share in (False, True):
            monkeypatch.setattr(shared_prompt, "SHARE_PROMPTS", share)
            with torch.no_grad():
                results[share] = forward.response_vocab_stats(model, batch, 1.0, vocab_extra=extra)[
                    2
                ]
        assert len(results[True]) == len(results[False]) > 0
        for ours, theirs in zip(results[True], results[False]):
            assert ours.shape == theirs.shape
            torch.testing.assert_close(ours[real], theirs[real], rtol=0, atol=2e-5)


def test_the_block_mask_lists_the_tiles_create_block_mask_would(monkeypatch):
    """Flex attention's block mask, sorted a few query tiles at a time: the same tiles seen in
    part and seen whole as create_block_mask's (which evaluates the whole [rows, L, L] mask at
    once), over blocks longer than a tile: a 300-token prompt and responses of 1 to 260."""
    from torch.nn.attention.flex_attention import create_block_mask

    from keel.training.shared_prompt import allowed

    batch = padded_batch(50, [300, 300, 300, 120, 120], [260, 1, 140, 200, 7], seed=2, low=3)
    prompts = batch.prompt_ids.clone()
    prompts[1], prompts[2], prompts[4] = prompts[0], prompts[0], prompts[3]
    batch = dataclasses.replace(batch, prompt_ids=prompts)
    shared = shared_prompts(batch.input_ids, batch.attention_mask, 260)
    # a tile's worth of mask at a time: the rows are sorted in several steps
    monkeypatch.setattr(shared_prompt, "MASK_ELEMENTS", 1)
    ours = shared.mask(flex=True)
    rows, length = shared.segments.shape

    def mask_mod(row, head, query, key):
        return allowed(shared.segments[row], query, key)

    theirs = create_block_mask(mask_mod, rows, None, length, length, device="cpu")
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, theirs.full_kv_num_blocks)
    assert ours.full_kv_num_blocks.sum() > 0 and (ours.kv_num_blocks > 0).all()


def test_nothing_is_shared_where_every_response_is_empty():
    batch = _grouped_batch(50)
    empty = dataclasses.replace(batch, response_mask=torch.zeros_like(batch.response_mask))
    assert shared_prompts(empty.input_ids, empty.attention_mask, 6) is None


def test_a_model_with_attention_dropout_keeps_each_samples_own_pass(tiny_assets, monkeypatch):
    """Flex attention has no dropout: a model that drops attention weights is not shared, so its
    training keeps the dropout it was configured with."""
    monkeypatch.setattr(shared_prompt, "SHARE_PROMPTS", True)
    model = load_causal_lm(tiny_assets["model"], torch.device("cpu"))
    batch = _grouped_batch(model.config.vocab_size)
    assert shared_prompt.shared_prompts_of(batch, model.config) is not None
    model.config.attention_dropout = 0.1
    assert shared_prompt.shared_prompts_of(batch, model.config) is None


def test_the_block_masks_mask_traces_without_reading_an_index():
    """Compiled flex attention traces the mask with its row, query and key as 0-d tensors. Read
    as a Python int (an ellipsis beside a 0-d index does that), an index is data the compiled
    graph cannot hold: torch 2.11's flex attention broke out of its graph and failed on an H100.
    Traced for real, as flex attention's own trace rewrites indexing, the mask reads no value and
    gives the mask's answer."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.fx.experimental.proxy_tensor import make_fx

    batch = _grouped_batch(50)
    shared = shared_prompts(batch.input_ids, batch.attention_mask, 6)
    mask_mod = shared.mask(flex=True).mask_mod
    index = (torch.tensor(0), torch.tensor(0), torch.tensor(5), torch.tensor(2))
    with TransformGetItemToIndex():
        traced = make_fx(mask_mod)(*index)
    dense = shared.mask(flex=False)
    # a response reading its prompt, another response, itself; padding reading the prompt
    seen = [(0, 5, 2), (0, 11, 5), (1, 6, 3), (1, 3, 3), (1, 12, 2), (2, 9, 0)]
    answers = [
        bool(traced(torch.tensor(row), torch.tensor(0), torch.tensor(query), torch.tensor(key)))
        for row, query, key in seen
    ]
    assert answers == [bool(dense[row, 0, query, key]) for row, query, key in seen]
    assert answers == [True, False, False, True, False, True]


def test_keels_flex_attention_computes_in_autocasts_dtype_and_refuses_what_it_cannot_do(
    monkeypatch,
):
    """Under autocast the query and key leave RoPE in float32 beside a bf16 value: keel's flex
    attention hands flex all three in autocast's dtype, as SDPA is cast (no float32 kernel, no
    dtype mismatch on a torch whose flex attention does not cast). Dropout, a softcap or sinks it
    does not do, and says so rather than leaving them out."""
    from keel.training.shared_prompt import flex_attention_forward

    batch = _grouped_batch(50)
    shared = shared_prompts(batch.input_ids, batch.attention_mask, 6)
    rows, length = shared.segments.shape
    query, key = torch.randn(rows, 4, length, 16), torch.randn(rows, 2, length, 16)
    value = torch.randn(rows, 2, length, 16, dtype=torch.bfloat16)
    block_mask = shared.mask(flex=True)
    given = []
    compiled = shared_prompt._compiled_flex_attention()

    def recorded(q, k, v, **options):
        given.append((q.dtype, k.dtype, v.dtype))
        return compiled(q, k, v, **options)

    monkeypatch.setattr(shared_prompt, "_compiled_flex_attention", lambda: recorded)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        out, _ = flex_attention_forward(None, query, key, value, block_mask, scaling=0.25)
    assert given == [(torch.bfloat16,) * 3]
    assert out.dtype == torch.bfloat16 and out.shape == (rows, length, 4, 16)
    for unsupported in ({"dropout": 0.1}, {"softcap": 30.0}, {"s_aux": torch.zeros(4)}):
        with pytest.raises(NotImplementedError, match="no dropout, softcap or sinks"):
            flex_attention_forward(None, query, key, value, block_mask, **unsupported)


def test_micro_batches_of_empty_prompts_are_cut_by_length_when_sharing(monkeypatch):
    """Only empty prompts (width 0 once trimmed): nothing to share, and the micro-batches are
    the unshared ones, not a crash in grouping rows of no tokens."""
    from keel.training.batching import MicroBatching, micro_batches

    batch = padded_batch(50, [0, 0, 0], [3, 1, 2], seed=1, low=3)
    monkeypatch.setattr(shared_prompt, "SHARE_PROMPTS", True)
    assert batch.prompt_ids.shape[1] == 0
    assert [rows.tolist() for rows, _ in micro_batches(batch, MicroBatching(2))] == [[1, 2], [0]]
