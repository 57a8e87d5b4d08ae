"""The update's GPU paths: logits kept for backward equal the recomputed ones under the compiled
vocabulary arithmetic, the compiled log-prob's closed-form backward equals autograd's, and fused
AdamW refuses a non-finite step on the device; shared prompts through flex attention. Run on the
GPU machine."""

import pytest
import torch
import torch.nn.functional as F

from keel.errors import NONFINITE_LOSS, KeelError
from keel.models.load import autocast, load_causal_lm
from keel.training import forward
from keel.training.optim import build_optimizer
from keel.training.step import apply_gradients

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda")


def _log_probs_and_gradients(model, recompute: bool, monkeypatch):
    monkeypatch.setattr(
        forward,
        "logits_chunking",
        lambda positions, vocab, device, grad, **_: forward.LogitsChunking(16, recompute and grad),
    )
    generator = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (4, 40), device=CUDA, generator=generator)
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(40, device=CUDA).expand(4, -1),
    }
    model.zero_grad(set_to_none=True)
    with autocast(CUDA, torch.bfloat16):
        log_probs, entropy, _ = forward.decoder_token_stats(
            model, inputs, ids[:, 20:], 0.9, with_entropy=True, entropy_grad=False, fused_vocab=True
        )
    log_probs.sum().backward()
    return log_probs.detach(), entropy, [p.grad.clone() for p in model.parameters()]


def test_kept_logits_give_the_recomputed_log_probs_and_gradients(tiny_assets, monkeypatch):
    model = load_causal_lm(tiny_assets["model"], CUDA)
    recomputed = _log_probs_and_gradients(model, True, monkeypatch)
    kept = _log_probs_and_gradients(model, False, monkeypatch)
    assert torch.equal(recomputed[0], kept[0]) and torch.equal(recomputed[1], kept[1])
    assert all(torch.allclose(a, b, rtol=1e-3, atol=1e-6) for a, b in zip(recomputed[2], kept[2]))
    assert any(g.abs().sum() > 0 for g in kept[2])


def test_fused_adamw_refuses_a_nonfinite_step_on_the_device():
    model = torch.nn.Linear(64, 8).to(CUDA)
    optimizer = build_optimizer(model.parameters(), _optim_cfg())
    assert optimizer.defaults["fused"]
    model(torch.randn(2, 64, device=CUDA)).sum().backward()
    assert apply_gradients(model, optimizer, 1.0, "actor")["actor/grad_norm"] > 0
    before = [p.detach().clone() for p in model.parameters()]
    steps = optimizer.state[model.weight]["step"].clone()
    x = torch.randn(2, 64, device=CUDA)
    x[0, 3] = float("nan")
    model(x).sum().backward()
    with pytest.raises(KeelError) as error:
        apply_gradients(model, optimizer, 1.0, "actor")
    assert error.value.code == NONFINITE_LOSS
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert torch.equal(optimizer.state[model.weight]["step"], steps)


def _optim_cfg():
    from types import SimpleNamespace

    return SimpleNamespace(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)


def test_a_batch_moves_to_the_gpu_without_waiting_for_it():
    """TrainBatch.to copies without a stream synchronisation (a blocking copy would drain the
    GPU's queue mid-update); torch's sync debug mode raises on any synchronising call."""
    from keel.types import TrainBatch

    n, r = 4, 6
    batch = TrainBatch(
        prompt_ids=torch.ones(n, 3, dtype=torch.long),
        prompt_mask=torch.ones(n, 3, dtype=torch.long),
        response_ids=torch.arange(n * r).view(n, r)[:, 1:],
        response_mask=torch.ones(n, r - 1),
        sampling_log_probs=torch.randn(n, r - 1),
        group_index=torch.arange(n),
        records=[None] * n,
        response_texts=[""] * n,
        truncated=torch.zeros(n, dtype=torch.bool),
        scores=torch.zeros(n),
        token_level_rewards=torch.zeros(n, r - 1),
        advantages=torch.zeros(n, r - 1),
        returns=torch.zeros(n, r - 1),
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            # the blocking copy the update used to make
            batch.response_ids.to(CUDA)
        moved = batch.to(CUDA)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert moved.response_ids.is_cuda and torch.equal(moved.response_ids.cpu(), batch.response_ids)
    assert (
        torch.equal(moved.sampling_log_probs.cpu(), batch.sampling_log_probs)
        and moved.records == batch.records
    )


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_the_compiled_target_log_prob_backward_equals_autograds(temperature):
    """The update's compiled vocabulary arithmetic (fused_vocab) at a real vocabulary's width, bf16
    logits as autocast's lm_head makes them: its closed-form backward (one pass over the logits)
    gives autograd's gradient through log_softmax, to one bf16 rounding."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    logits = 4 * torch.randn(512, 151_936, device=CUDA, generator=generator)
    logits = logits.to(torch.bfloat16)
    targets = torch.randint(0, 151_936, (512,), device=CUDA, generator=generator)
    weights = torch.randn(512, device=CUDA, generator=generator)
    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()

    log_probs, entropy, _ = forward._compiled_token_stats()(ours, targets, temperature, True, False)
    (log_probs * weights).sum().backward()
    z = theirs.float() / temperature
    expected = torch.log_softmax(z, -1).gather(-1, targets[:, None]).squeeze(-1)
    (expected * weights).sum().backward()

    torch.testing.assert_close(log_probs, expected.detach(), rtol=0, atol=2e-5)
    assert not entropy.requires_grad
    assert ours.grad.dtype == torch.bfloat16 and ours.grad.abs().sum() > 0
    torch.testing.assert_close(ours.grad.float(), theirs.grad.float(), rtol=8e-3, atol=1e-8)


def test_the_fused_step_clips_on_the_device_as_clip_then_step_does():
    """On the GPU the fused AdamW divides each gradient by the clip's divisor as it reads it
    (grad_scale): the weights after two clipped steps (norms 5 and 2.2 against 1) are those of
    clip_grads_with_norm_ and a plain step, and the norms reported are those before clipping."""
    from keel.training.step import clip_gradients

    def stepped(fused: bool):
        model = torch.nn.Linear(2, 1, bias=False).to(CUDA)
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[0.5, -0.25]]))
        optimizer = build_optimizer(model.parameters(), _optim_cfg())
        assert optimizer.defaults["fused"]
        norms = []
        for x in ([[3.0, 4.0]], [[-1.0, 2.0]]):
            model(torch.tensor(x, device=CUDA)).sum().backward()
            if fused:
                norms.append(apply_gradients(model, optimizer, 1.0, "actor")["actor/grad_norm"])
            else:
                norms.append(clip_gradients(list(model.parameters()), 1.0).item())
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        return model.weight.detach(), norms

    (fused, fused_norms), (plain, plain_norms) = stepped(True), stepped(False)
    torch.testing.assert_close(fused, plain, rtol=0, atol=1e-6)
    assert fused_norms == pytest.approx(plain_norms) and fused_norms[0] == pytest.approx(5.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prompts_through_flex_attention_give_each_samples_own_pass(
    tiny_assets, monkeypatch, dtype
):
    """On the GPU a prompt's samples share its pass through flex attention's block mask, forward
    and backward: the log-probs and gradients of each sample's own [prompt | response] pass (to
    float32's rounding, or to bf16 autocast's), on prompts and responses of varied lengths."""
    import dataclasses

    from keel.training import shared_prompt

    from tests_helpers import padded_batch

    model = load_causal_lm(tiny_assets["model"], CUDA)
    batch = padded_batch(model.config.vocab_size, [4, 2, 5, 4, 2, 4], [6, 3, 5, 1, 6, 4], 3, 3)
    prompts = batch.prompt_ids.clone()
    prompts[3], prompts[5], prompts[4] = prompts[0], prompts[0], prompts[1]
    batch = dataclasses.replace(batch, prompt_ids=prompts)
    mask = batch.response_mask.bool().to(CUDA)

    def log_probs_and_gradients(share: bool):
        monkeypatch.setattr(shared_prompt, "SHARE_PROMPTS", share)
        model.zero_grad(set_to_none=True)
        with autocast(CUDA, dtype):
            log_probs, _ = forward.response_log_probs(model, batch, 0.8)
        (log_probs * mask).sum().backward()
        return log_probs * mask, [p.grad.clone() for p in model.parameters()]

    own, shared = log_probs_and_gradients(False), log_probs_and_gradients(True)
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(shared[0], own[0], rtol=0, atol=tolerance)
    for ours, theirs in zip(shared[1], own[1]):
        torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance * 1e-2)
    assert any(g.abs().sum() > 0 for g in own[1])


# (query heads, key heads, prompts' lengths, responses' lengths): Qwen2.5-0.5B's heads over blocks
# longer than a tile; four query heads a key head over rows shorter than one, where flex would pick
# its decoding kernel
FLEX_SHAPES = {
    "long": (14, 2, [300, 300, 300, 120, 120], [260, 1, 140, 200, 7]),
    "short": (8, 2, [40, 40, 40, 20, 20], [30, 5, 20, 12, 3]),
}


@pytest.mark.parametrize("inside_compile", [False, True])
@pytest.mark.parametrize("shape", FLEX_SHAPES)
def test_keels_flex_attention_equals_sdpa_under_the_dense_mask(shape, inside_compile):
    """keel's flex attention function (shared_prompt.KEEL_FLEX), its grouped heads through flex's
    own grouping: its output and its gradients are float32 SDPA's under the dense mask (to bf16's
    rounding), called eagerly (flex compiled on its own) and inside a compiled function (traced
    into its graph, as in keel's compiled layers)."""
    import dataclasses

    from keel.training.shared_prompt import flex_attention_forward, shared_prompts

    from tests_helpers import padded_batch

    heads, key_heads, prompt_lengths, response_lengths = FLEX_SHAPES[shape]
    batch = padded_batch(50, prompt_lengths, response_lengths, seed=2, low=3)
    prompts = batch.prompt_ids.clone()
    prompts[1], prompts[2], prompts[4] = prompts[0], prompts[0], prompts[3]
    batch = dataclasses.replace(batch, prompt_ids=prompts)
    shared = shared_prompts(batch.input_ids, batch.attention_mask, max(response_lengths)).to(CUDA)
    rows, length = shared.segments.shape
    assert (length > 128) == (shape == "long")
    generator = torch.Generator(device="cuda").manual_seed(0)

    def leaf(count):
        x = torch.randn(rows, count, length, 64, device=CUDA, generator=generator)
        return x.to(torch.bfloat16).requires_grad_()

    query, key, value = leaf(heads), leaf(key_heads), leaf(key_heads)
    block_mask, dense = shared.mask(flex=True), shared.mask(flex=False)

    def flex(q, k, v):
        return flex_attention_forward(None, q, k, v, block_mask, scaling=0.125)[0]

    out = (torch.compile(flex) if inside_compile else flex)(query, key, value)
    out.float().square().sum().backward()
    ours = [out.detach(), *(x.grad for x in (query, key, value))]
    for x in (query, key, value):
        x.grad = None
    group = heads // key_heads
    reference = F.scaled_dot_product_attention(
        query.float(), key.float().repeat_interleave(group, 1),
        value.float().repeat_interleave(group, 1), attn_mask=dense, scale=0.125,
    ).transpose(1, 2)  # fmt: skip
    reference.square().sum().backward()
    theirs = [reference.detach(), *(x.grad for x in (query, key, value))]
    for got, want in zip(ours, theirs):  # to bf16's rounding, as a share of each tensor's norm
        assert (got.float() - want.float()).norm() <= 1e-2 * want.float().norm()
    assert theirs[1].abs().sum() > 0
