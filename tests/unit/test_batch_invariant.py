"""rollout.batch_invariant on CPU: the sampler's log-probs and the old-log-prob pass (the engine's
prefill of each whole sequence) are equal bit for bit, in float32 and bfloat16, with prompts of
different lengths decoded together and prefilled in pieces; without it the same comparison
differs. The row-at-a-time functions equal the fused ones to rounding."""

import pytest
import torch
import torch.nn.functional as F

from keel.data.prompts import build_prompt_dataset, collate_prompts
from keel.models.load import load_causal_lm, load_tokenizer
from keel.rollout.native import NativeRolloutEngine, invariant
from keel.rollout.native.scoring import score
from keel.types import SamplingParams

PROMPTS = [
    {"prompt": "Digits please: 1"},
    {"prompt": [{"role": "user", "content": "a longer prompt here, padded"}]},
    {"prompt": "x"},
]


def sampled_and_scored(model_dir, dtype, batch_invariant: bool, **engine_args):
    """(the sampler's log-probs, the engine's prefill of the same sequences, the response mask)."""
    tokenizer, model = load_tokenizer(model_dir), load_causal_lm(model_dir, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    records, _ = build_prompt_dataset(PROMPTS, tokenizer, max_prompt_length=64)
    prompts = collate_prompts(records, tokenizer.pad_token_id).repeat_interleave(3)
    engine = NativeRolloutEngine(
        model, tokenizer, 256, dtype, batch_invariant=batch_invariant, **engine_args
    )
    torch.manual_seed(0)
    params = SamplingParams(n=3, temperature=0.9, max_new_tokens=12, ignore_eos=True)
    batch = engine.generate(prompts, params)
    return batch.sampling_log_probs, score(engine, batch, 0.9), batch.response_mask


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sampler_and_the_old_log_prob_pass_are_equal_bit_for_bit(tmp_path, arch, dtype):
    from keel.models.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path / arch, arch=arch, hidden_size=64, num_layers=2, seed=1)
    # prompts prefilled in pieces of 8 tokens (chunked prefill), decoded nine rows at a time
    sampled, scored, mask = sampled_and_scored(model_dir, dtype, True, max_num_batched_tokens=8)
    assert mask.sum() == 9 * 12
    assert torch.equal(sampled * mask, scored * mask)
    # the same comparison without it: the decode step's fused arithmetic is not the prefill's
    sampled, scored, mask = sampled_and_scored(model_dir, dtype, False)
    assert not torch.equal(sampled * mask, scored * mask)


def test_the_row_functions_equal_the_fused_ones_to_rounding():
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 3, 32), torch.randn(16, 32), torch.randn(16)
    with invariant.RowInvariant():
        rows = (
            F.linear(x, w, b),
            F.rms_norm(x, (32,), eps=1e-6),
            torch.logsumexp(x, dim=-1),
            F.silu(x),
            x.cos(),
        )
    fused = (F.linear(x, w, b), F.rms_norm(x, (32,), eps=1e-6), torch.logsumexp(x, -1))
    for got, want in zip(rows, (*fused, F.silu(x), x.cos())):
        torch.testing.assert_close(got, want)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    keys = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    want = F.scaled_dot_product_attention(q, *keys, is_causal=True)
    with invariant.RowInvariant():
        causal = F.scaled_dot_product_attention(q, *keys, is_causal=True)
        masked = F.scaled_dot_product_attention(q, *keys, attn_mask=mask)
    torch.testing.assert_close(causal, want)
    torch.testing.assert_close(masked, want)
