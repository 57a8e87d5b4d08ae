"""The target log-prob's closed-form backward (training/target_log_prob.py) against autograd's own
through log_softmax: the same log-probs and the same gradient, alone and on the update's path
(lm_head in chunks, recomputed under checkpointing)."""

import pytest
import torch

from keel.algorithms.utils import entropy_from_logits
from keel.training import forward
from keel.training.target_log_prob import target_log_probs


def _reference(logits, targets, temperature):
    z = logits.float() / temperature
    return torch.log_softmax(z, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_and_their_gradient_equal_autograds_through_log_softmax(dtype, temperature):
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(6, 5, 300, generator=generator)).to(dtype)
    targets = torch.randint(0, 300, (6, 5), generator=generator)
    weights = torch.randn(6, 5, generator=generator)
    ours = logits.clone().requires_grad_()
    theirs = logits.clone().requires_grad_()

    log_probs, entropy = target_log_probs(ours, targets, temperature)
    (log_probs * weights).sum().backward()
    expected = _reference(theirs, targets, temperature)
    (expected * weights).sum().backward()

    assert entropy is None
    torch.testing.assert_close(log_probs, expected.detach(), rtol=0, atol=1e-5)
    assert ours.grad.dtype == dtype
    # bf16: one rounding of the same float32 value, at most
    torch.testing.assert_close(
        ours.grad, theirs.grad, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-6
    )
    assert ours.grad.abs().sum() > 0


def test_the_entropy_comes_without_a_gradient():
    logits = torch.randn(4, 50, requires_grad=True)
    targets = torch.randint(0, 50, (4,))
    log_probs, entropy = target_log_probs(logits, targets, 0.5, with_entropy=True)
    assert not entropy.requires_grad and log_probs.requires_grad
    torch.testing.assert_close(entropy, entropy_from_logits(logits.detach() / 0.5))


@pytest.mark.parametrize("recompute", [False, True])
def test_the_updates_chunked_lm_head_gets_autograds_gradients(recompute, monkeypatch):
    monkeypatch.setattr(
        forward,
        "logits_chunking",
        lambda positions, vocab, device, grad, **_: forward.LogitsChunking(7, recompute and grad),
    )
    generator = torch.Generator().manual_seed(1)
    lm_head = torch.nn.Linear(16, 90, bias=False)
    hidden = torch.randn(20, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 90, (20,), generator=generator)

    log_probs, _, _ = forward.vocab_token_stats(lm_head, hidden, targets, 0.9)
    log_probs.sum().backward()
    ours = hidden.grad.clone(), lm_head.weight.grad.clone()
    hidden.grad, lm_head.weight.grad = None, None
    _reference(lm_head(hidden), targets, 0.9).sum().backward()

    torch.testing.assert_close(ours[0], hidden.grad)
    torch.testing.assert_close(ours[1], lm_head.weight.grad)
    assert ours[1].abs().sum() > 0
