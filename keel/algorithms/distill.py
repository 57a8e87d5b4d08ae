"""On-policy distillation's two signals, from the teacher's view of the student's own samples.

- `reverse_kl_advantages`: per sampled token, minus an estimate of KL(student || teacher) at that
  token, the advantage of a policy-gradient update (Thinking Machines' on-policy distillation:
  no discount, each token judged by the teacher at its own position). With k1 it is the teacher's
  log-prob minus the student's; its expectation under the student is minus the reverse KL, whose
  gradient the policy gradient then follows.
- `generalized_jsd`: Agarwal et al.'s generalised Jensen-Shannon divergence (TRL's
  `GKDTrainer.generalized_jsd_loss`) between the teacher's and the student's next-token
  distributions at every response position, over the teacher's top-k tokens, both renormalised
  there. With k = the vocabulary it is TRL's loss exactly.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .kl import kl_penalty
from .utils import masked_mean

# exp(-1e4) is 0 in float32
_LOG_ZERO = -1e4


def reverse_kl_advantages(
    student_log_probs: Tensor, teacher_log_probs: Tensor, mask: Tensor, coef: float, estimator: str
) -> Tensor:  # [N, R]
    """-coef x the per-token estimate of KL(student || teacher) on the sampled tokens [N, R]."""
    return -coef * kl_penalty(student_log_probs, teacher_log_probs, estimator) * mask


def generalized_jsd(student_log_probs: Tensor, teacher_log_probs: Tensor, beta: float) -> Tensor:
    """Per position [...]: JSD_beta between teacher and student over the last dimension (the
    teacher's top-k tokens, or the vocabulary), each side renormalised over it. beta 0: KL(teacher
    || student), forward; beta 1: KL(student || teacher), reverse; between: beta KL(teacher || M) +
    (1 - beta) KL(student || M) with M = beta teacher + (1 - beta) student."""
    # a token of probability 0 (a -inf logit) adds 0 and no NaN to the sums or their gradients
    student = torch.log_softmax(student_log_probs.float(), dim=-1).clamp(min=_LOG_ZERO)
    teacher = torch.log_softmax(teacher_log_probs.float(), dim=-1).clamp(min=_LOG_ZERO)
    if beta == 0:
        return _kl(teacher, student)
    if beta == 1:
        return _kl(student, teacher)
    mixture = torch.logsumexp(
        torch.stack([student + math.log1p(-beta), teacher + math.log(beta)]), dim=0
    )
    return beta * _kl(teacher, mixture) + (1 - beta) * _kl(student, mixture)


def _kl(p_log: Tensor, q_log: Tensor) -> Tensor:
    """KL(p || q) over the last dimension, from log-probabilities."""
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def distill_metrics(
    student_log_probs: Tensor, teacher_log_probs: Tensor, mask: Tensor
) -> dict[str, float]:
    """distill/reverse_kl: the k1 estimate of KL(student || teacher) per sampled token (the mean
    of log s - log t over the student's own samples); distill/teacher_log_prob and
    distill/student_log_prob: the two log-probs of the sampled tokens, per token."""
    return {
        "distill/reverse_kl": masked_mean(student_log_probs - teacher_log_probs, mask).item(),
        "distill/teacher_log_prob": masked_mean(teacher_log_probs, mask).item(),
        "distill/student_log_prob": masked_mean(student_log_probs, mask).item(),
    }
