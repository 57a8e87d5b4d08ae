"""The log-prob of each target token from logits, with a backward that writes the logits' gradient
in one pass over them.

autograd's backward of `z.gather(target) - logsumexp(z)` makes the gather's gradient first: a
[tokens, V] float32 tensor of zeros with g scattered in (2.5 GB for a chunk of 4,096 positions of
a 151k vocabulary), then reads it back beside the logits. The gradient is known in closed form,
g (onehot(target) - softmax(z)), so one elementwise pass makes it from the logits and the saved
logsumexp: under torch.compile one kernel that reads the logits once and writes their gradient
once (t1's update: two kernels of 0.75 and 1.6 ms a chunk before, eight chunks a step)."""

from __future__ import annotations

import torch
from torch import Tensor

from keel.algorithms.utils import entropy_from_logits


def target_log_probs(
    logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """log softmax(logits / temperature) at each target [...] from logits [..., V] (any float
    dtype, computed in float32), and the entropy [...] without a gradient when asked."""
    return _TargetLogProb.apply(logits, targets, temperature, with_entropy)


class _TargetLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool):
        z = logits.float()
        if temperature != 1.0:
            z = z / temperature
        lse = torch.logsumexp(z, dim=-1)
        log_probs = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        entropy = entropy_from_logits(z, lse) if with_entropy else None
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad: Tensor, _entropy_grad: Tensor | None):
        logits, targets, lse = ctx.saved_tensors
        return logits_gradient(logits, targets, lse, grad, ctx.temperature), None, None, None


def logits_gradient(
    logits: Tensor, targets: Tensor, lse: Tensor, grad: Tensor, temperature: float
) -> Tensor:
    """d(sum grad * log_prob) / d logits, in the logits' dtype: grad (onehot(target) - softmax(z))
    / temperature, z = logits / temperature, softmax from the forward's logsumexp."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    gradient = torch.exp(z - lse.unsqueeze(-1))
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    # onehot - softmax in place, without a float [..., V] one-hot (eager's memory; compiled, the
    # whole function is one kernel either way)
    gradient.neg_().add_(vocab == targets.unsqueeze(-1))
    scale = grad if temperature == 1.0 else grad / temperature
    return gradient.mul_(scale.unsqueeze(-1)).to(logits.dtype)
