"""rollout.batch_invariant on CPU: the sampler's log-probs and the old-log-prob pass (the engine's
prefill of each whole sequence) are equal bit for bit, in float32 and bfloat16, with prompts of
different lengths decoded together and prefilled in pieces; without it the same comparison
differs. The row-at-a-time functions equal the fused ones to rounding."""

import dataclasses

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
    if dtype == torch.float32:
        # The same comparison without it: the decode step's fused arithmetic is not the prefill's.
        # (float32 only: on a CPU without AVX-512, bfloat16's matmuls at these tiny shapes can
        # happen to be batch-invariant already, so there the control proves nothing either way.)
        sampled, scored, mask = sampled_and_scored(model_dir, dtype, False)
        assert not torch.equal(sampled * mask, scored * mask)


def test_a_row_without_a_response_scores_nothing(tmp_path):
    """A rank's share of a batch is made even with padding rows (no response): they score 0."""
    from keel.models.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path, hidden_size=64, num_layers=2)
    tokenizer, model = load_tokenizer(model_dir), load_causal_lm(model_dir, torch.device("cpu"))
    records, _ = build_prompt_dataset(PROMPTS, tokenizer, max_prompt_length=64)
    prompts = collate_prompts(records, tokenizer.pad_token_id)
    engine = NativeRolloutEngine(model, tokenizer, 256, torch.float32, batch_invariant=True)
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=4, ignore_eos=True)
    batch = engine.generate(prompts, params)
    padded = dataclasses.replace(
        batch, response_mask=batch.response_mask * torch.tensor([[1], [0], [1]])
    )
    scored = score(engine, padded, 1.0)
    assert scored[1].eq(0).all() and scored[0].ne(0).all()
    assert torch.equal(scored[[0, 2]], batch.sampling_log_probs[[0, 2]])


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
    # logsumexp over any dims, as torch's takes them
    for dim, keepdim in ((1, True), ((0, 2), False), ((0, 2), True)):
        with invariant.RowInvariant():
            got = torch.logsumexp(x, dim=dim, keepdim=keepdim)
        torch.testing.assert_close(got, torch.logsumexp(x, dim=dim, keepdim=keepdim))


def causal_attention_case(length=6, heads=4, kv_heads=2, dim=16):
    """Queries at every position of two cache rows, against SDPA's causal attention."""
    torch.manual_seed(0)
    q = torch.randn(2, heads, length, dim)
    k_cache, v_cache = torch.randn(2, kv_heads, length, dim), torch.randn(2, kv_heads, length, dim)
    group = heads // kv_heads
    want = F.scaled_dot_product_attention(
        q,
        k_cache.repeat_interleave(group, dim=1),
        v_cache.repeat_interleave(group, dim=1),
        is_causal=True,
    )
    rows = torch.arange(2).repeat_interleave(length)
    last = torch.arange(length).repeat(2)
    queries = q.transpose(1, 2).flatten(0, 1)  # [2 * length, H, D]
    return (queries, k_cache, v_cache, rows, torch.zeros_like(last), last), want


def test_attention_over_each_querys_columns_equals_sdpa_to_rounding():
    args, want = causal_attention_case()
    got = invariant.attend_reference(*args)
    torch.testing.assert_close(got.view(2, 6, 4, 16).transpose(1, 2), want)


def test_the_gpu_kernels_equal_the_fused_functions_under_tritons_interpreter():
    """invariant_kernels under TRITON_INTERPRET=1 (numpy), in a process of its own: the interpreter
    is chosen at import. Where Triton is installed (not in keel's CPU install)."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    code = """
import torch, torch.nn.functional as F
from keel.rollout.native import invariant, invariant_kernels as kernels
import test_batch_invariant as case
torch.manual_seed(0)
x, w, b = torch.randn(70, 100), torch.randn(80, 100), torch.randn(80)
torch.testing.assert_close(kernels.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
# a narrow weight with a long K: summed in 4 chunks, and a row's numbers are the same whatever
# rows come with it
x, w, b = torch.randn(70, 1100), torch.randn(96, 1100), torch.randn(96)
full = kernels.linear(x, w, b)
torch.testing.assert_close(full, F.linear(x, w, b), rtol=1e-4, atol=1e-4)
for rows in (slice(0, 3), slice(5, 6), slice(64, 70)):
    assert torch.equal(kernels.linear(x[rows], w, b), full[rows])
x = x[:, :100]
torch.testing.assert_close(kernels.rms_norm(x, (100,), eps=1e-6), F.rms_norm(x, (100,), eps=1e-6))
v = torch.randn(3, 5000)
v[1, :4096] = v[2] = float("-inf")  # a first block of -inf, a row of -inf: not NaN
torch.testing.assert_close(kernels.logsumexp(v, -1), torch.logsumexp(v, -1))
torch.testing.assert_close(kernels.logsumexp(x, 0, True), torch.logsumexp(x, 0, True))
for dim in (16, 8):  # 8: padded to tl.dot's least 16
    args, want = case.causal_attention_case(length=70, dim=dim)
    got = kernels.attend(*args).view(2, 70, 4, dim).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
# as operators torch.compile traces (a batch-invariant decode step is compiled): their shapes as
# the tracer sees them are those they return, and a compiled caller gets the kernels' own bits
x3, w, b = torch.randn(2, 5, 100), torch.randn(80, 100), torch.randn(80)
for args in ((x3, w, b), (x3, w, None)):
    torch.library.opcheck(torch.ops.keel.invariant_linear, args)
torch.library.opcheck(torch.ops.keel.invariant_rms_norm, (x3, [100], torch.randn(100), 1e-6))
for dims, keep in (([-1], False), ([0, 2], True)):
    torch.library.opcheck(torch.ops.keel.invariant_logsumexp, (x3, dims, keep))
traced = torch.compile(lambda x, w: invariant.KERNELS[F.linear](x, w) * 2, fullgraph=True)
for rows in (3, 7, 11):
    x = torch.randn(rows, 100)
    assert torch.equal(traced(x, w), kernels.linear(x, w) * 2)
print("ok")
"""
    here = os.path.dirname(__file__)
    path = os.pathsep.join([os.getcwd(), here, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.stdout.strip() == "ok", done.stderr[-3000:]


def test_narrow_matmuls_sum_k_in_chunks_set_by_the_weights_shape():
    """Qwen2.5-0.5B's decode step: its down projection (896 columns, K 4864) and o projection run
    in K chunks, so 128 rows still make enough programs; the wide gate-up and the vocabulary's
    head keep one pass over K. The chunks take the weight's shape only, never the rows."""
    from keel.rollout.native.invariant_kernels import k_chunks

    tiles = 4864 // 64
    assert k_chunks(896, 4864) < tiles and k_chunks(896, 896) < 896 // 64
    assert k_chunks(9728, 896) == 896 // 64 and k_chunks(151936, 896) == 896 // 64


def test_the_engine_choice_refuses_hf_where_the_config_rule_was_passed_by(tiny_assets):
    """keel.rollout.select.engine_for, as a library caller reaches it: hf is no batch-invariant
    engine."""
    from transformers import AutoConfig

    from keel.errors import BATCH_INVARIANT_UNSUPPORTED, KeelError
    from keel.rollout.select import engine_for

    config = AutoConfig.from_pretrained(tiny_assets["model"])
    assert engine_for("native", config, batch_invariant=True) == ("native", None)
    with pytest.raises(KeelError) as raised:
        engine_for("hf", config, batch_invariant=True)
    assert raised.value.code == BATCH_INVARIANT_UNSUPPORTED and "hf" in raised.value.message
