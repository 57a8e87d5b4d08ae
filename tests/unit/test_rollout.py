"""The hf rollout engine: masks after EOS, n samples, and log-probs the trainer agrees with."""

import pytest
import torch

from keel.data.prompts import build_prompt_dataset, collate_prompts
from keel.models.load import load_causal_lm, load_tokenizer
from keel.rollout.assemble import mask_after_eos, padded_rows
from keel.rollout.hf import HFRolloutEngine
from keel.training.batching import MicroBatching
from keel.training.forward import batched_log_probs
from keel.types import SamplingParams


def test_sampled_rows_of_different_lengths_are_padded_on_the_right_exactly():
    """The engine's turns (token ids, float32 log-probs as lists) become one tensor each, every
    value kept exactly and `fill` after the shorter rows."""
    log_probs = torch.tensor([-0.1, -2.5, -1e-7], dtype=torch.float32).tolist()
    ids = padded_rows([[5, 151935, 7], [9]], 0, torch.long)
    values = padded_rows([log_probs, log_probs[:1]], 0.0, torch.float32)
    assert ids.dtype == torch.long and ids.tolist() == [[5, 151935, 7], [9, 0, 0]]
    assert values.dtype == torch.float32
    assert torch.equal(values[0], torch.tensor(log_probs)) and values[1].tolist()[1:] == [0.0, 0.0]


def test_mask_covers_tokens_up_to_first_eos():
    eos, pad = 9, 0
    ids = torch.tensor(
        [
            # EOS at 1: keep [5, 9], the rest becomes padding
            [5, 9, 7, 9],
            # no EOS, hit the limit: truncated
            [5, 6, 7, 8],
            [9, 0, 0, 0],
        ]
        # EOS first: a one-token response
    )
    masked, mask, truncated = mask_after_eos(ids, [eos], pad, max_new_tokens=4)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert masked.tolist() == [[5, 9, 0, 0], [5, 6, 7, 8], [9, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]


def _engine_and_prompts(tiny_assets, n):
    tokenizer = load_tokenizer(tiny_assets["model"])
    model = load_causal_lm(tiny_assets["model"], torch.device("cpu"))
    rows = [
        {"prompt": "Digits please: 1"},
        {"prompt": [{"role": "user", "content": "a longer prompt here"}]},
    ]
    records, _ = build_prompt_dataset(rows, tokenizer, max_prompt_length=64)
    prompts = collate_prompts(records, tokenizer.pad_token_id).repeat_interleave(n)
    return HFRolloutEngine(model, tokenizer, max_num_seqs=3), model, prompts


def test_n_samples_per_prompt_and_sampler_log_probs_match_the_trainer(tiny_assets):
    engine, model, prompts = _engine_and_prompts(tiny_assets, n=4)
    torch.manual_seed(0)
    # top-k/top-p truncate what is sampled, but the log-probs are those of the full distribution
    batch = engine.generate(
        prompts, SamplingParams(n=4, temperature=0.7, top_k=20, top_p=0.95, max_new_tokens=6)
    )

    assert len(batch) == 8 and batch.group_index.tolist() == [0] * 4 + [1] * 4
    assert batch.response_ids.shape[1] <= 6
    # sampling differs within a group
    assert len(set(map(tuple, batch.response_ids[:4].tolist()))) > 1
    # The trainer recomputes log-probs at the same temperature over [prompt | response]; with left
    # padding and chunked generation (3 sequences at a time) they must still agree.
    recomputed = batched_log_probs(model, batch, MicroBatching(5), temperature=0.7)
    assert torch.allclose(recomputed, batch.sampling_log_probs, atol=1e-4)
    assert (batch.sampling_log_probs[batch.response_mask == 0] == 0).all()


def test_greedy_generation_is_deterministic(tiny_assets):
    engine, _, prompts = _engine_and_prompts(tiny_assets, n=1)
    greedy = SamplingParams(do_sample=False, max_new_tokens=6)
    first, second = engine.generate(prompts, greedy), engine.generate(prompts, greedy)
    assert torch.equal(first.response_ids, second.response_ids)
    assert first.response_texts == second.response_texts


def test_checkpoint_generation_settings_do_not_leak_into_rollouts(tiny_assets, tmp_path):
    """An Instruct checkpoint's generation_config.json (repetition penalty, extra end-of-turn id)
    must not change what is sampled behind the trainer's back; its EOS ids do stop generation."""
    import shutil

    from transformers import GenerationConfig

    path = tmp_path / "instruct"
    shutil.copytree(tiny_assets["model"], path)
    tokenizer = load_tokenizer(path)
    stop_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    GenerationConfig(
        repetition_penalty=1.5,
        no_repeat_ngram_size=2,
        eos_token_id=[tokenizer.eos_token_id, stop_id],
    ).save_pretrained(path)
    engine, model, prompts = _engine_and_prompts({"model": path}, n=4)
    assert stop_id in engine.eos_ids

    torch.manual_seed(0)
    batch = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8))
    recomputed = batched_log_probs(model, batch, MicroBatching(8), temperature=1.0)
    assert torch.allclose(recomputed, batch.sampling_log_probs, atol=1e-4)
    # the user's model is left as it was
    assert model.generation_config.repetition_penalty == 1.5


# checkpointed chunks, or logits kept for backward
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("chunk", [3, 1024])
def test_chunked_log_probs_match_full_logits_values_and_gradients(
    tiny_assets, chunk, recompute, monkeypatch
):
    """The chunked lm_head path (no [tokens, vocab] logits at once) gives the same numbers and
    gradients as the full-logits path, here forced for comparison."""
    import copy

    from keel.training import forward

    engine, model, prompts = _engine_and_prompts(tiny_assets, n=2)
    torch.manual_seed(0)
    batch = engine.generate(prompts, SamplingParams(temperature=0.9, max_new_tokens=6))
    monkeypatch.setattr(
        forward,
        "logits_chunking",
        lambda positions, vocab, device, grad, **_: forward.LogitsChunking(
            chunk, recompute and grad
        ),
    )
    results = []
    # chunked, then the logits_to_keep path
    for plain in (forward.PLAIN_LM_HEAD, set()):
        monkeypatch.setattr(forward, "PLAIN_LM_HEAD", plain)
        m = copy.deepcopy(model)
        log_probs, entropy = forward.response_log_probs(
            m, batch, 0.9, with_entropy=True, entropy_grad=True
        )
        ((log_probs * batch.response_mask).sum() + entropy.sum() * 0.1).backward()
        results.append(
            (log_probs.detach(), entropy.detach(), [p.grad.clone() for p in m.parameters()])
        )
    (lp_a, ent_a, grads_a), (lp_b, ent_b, grads_b) = results
    assert torch.allclose(lp_a, lp_b, atol=1e-5) and torch.allclose(ent_a, ent_b, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads_a, grads_b))


def test_logits_are_kept_for_backward_only_where_they_fit_the_budget(monkeypatch):
    from keel.training.forward import (
        KEPT_LOGITS_CHUNK_TOKENS,
        LOGITS_CHUNK_TOKENS,
        LogitsChunking,
        logits_chunking,
    )

    gib = 1 << 30
    # t1's micro-batch: 2.4G logits
    gpu, vocab, micro = torch.device("cuda"), 151936, 32 * 512
    kept, recomputed = (
        LogitsChunking(KEPT_LOGITS_CHUNK_TOKENS, False),
        LogitsChunking(LOGITS_CHUNK_TOKENS, True),
    )

    def gpu_with(total_gb: float, free_gb: float, cached_unused_gb: float = 0.0):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _: (free_gb * gib, total_gb * gib))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda _: cached_unused_gb * gib)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda _: 0)

    compiled = dict(grad=True, compiled=True, entropy_grad=False)
    # an H200 with t1's training state: 14.1 GiB of budget, 8.1 GiB asked
    gpu_with(141, 110)
    assert logits_chunking(micro, vocab, gpu, **compiled) == kept
    # 8 B a logit
    assert logits_chunking(micro, vocab, gpu, **{**compiled, "entropy_grad": True}) == recomputed
    # eager: 4 B + 16 B
    assert logits_chunking(micro, vocab, gpu, **{**compiled, "compiled": False}) == recomputed
    assert logits_chunking(
        micro, vocab, gpu, grad=False, compiled=False, entropy_grad=False
    ) == LogitsChunking(
        KEPT_LOGITS_CHUNK_TOKENS,
        False,
        # no gradient: wider chunks, nothing kept
    )
    # nearly full: half of the 18 GiB free or cached
    gpu_with(141, 10, cached_unused_gb=8)
    assert logits_chunking(micro, vocab, gpu, **compiled) == kept
    gpu_with(141, 10)
    assert logits_chunking(micro, vocab, gpu, **compiled) == recomputed
    # 8 GiB of budget
    gpu_with(80, 70)
    assert logits_chunking(micro, vocab, gpu, **compiled) == recomputed
    assert logits_chunking(micro // 4, vocab, gpu, **compiled) == kept
    assert logits_chunking(micro, vocab, torch.device("cpu"), **compiled) == LogitsChunking(
        LOGITS_CHUNK_TOKENS, True
    )


def test_micro_batches_drop_columns_that_are_padding_in_all_their_samples():
    from keel.types import TrainBatch, pad_responses, trim_padding

    batch = TrainBatch(
        prompt_ids=torch.tensor([[0, 0, 5, 6], [0, 7, 8, 9]]),
        prompt_mask=torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]]),
        response_ids=torch.tensor([[1, 2, 0, 0], [3, 0, 0, 0]]),
        response_mask=torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]]),
        sampling_log_probs=torch.tensor([[-1.0, -2.0, 0.0, 0.0], [-3.0, 0.0, 0.0, 0.0]]),
        group_index=torch.tensor([0, 1]),
        records=["a", "b"],
        response_texts=["x", "y"],
        truncated=torch.tensor([False, False]),
        scores=torch.zeros(2),
        token_level_rewards=torch.zeros(2, 4),
        advantages=torch.zeros(2, 4),
        returns=torch.zeros(2, 4),
    )
    small = trim_padding(batch)
    # longest prompt: 3
    assert small.prompt_ids.tolist() == [[0, 5, 6], [7, 8, 9]]
    # longest response: 2
    assert small.response_ids.tolist() == [[1, 2], [3, 0]]
    assert small.sampling_log_probs.shape == (2, 2) and small.records == ["a", "b"]
    assert torch.equal(pad_responses(small.sampling_log_probs, 4), batch.sampling_log_probs)
