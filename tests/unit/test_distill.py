"""On-policy distillation's two signals against numbers worked out by hand and TRL 1.16's own code:
the reverse-KL advantage (k1 and k3 per token) and the generalised JSD (GKD), over the whole
vocabulary (TRL's `GKDTrainer.generalized_jsd_loss`, value and gradient) and over a top-k
support (both sides renormalised there)."""

import math
import os

import pytest
import torch

from keel.algorithms.distill import distill_metrics, generalized_jsd, reverse_kl_advantages
from keel.algorithms.utils import masked_mean

BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]
ATOL = 1e-5


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


# --- reverse-KL advantages ------------------------------------------------------------------


# per token: the student's and the teacher's log-prob of the sampled token
STUDENT = t([[-1.0, -2.0, -0.5], [-3.0, -0.2, -1.0]])
TEACHER = t([[-2.0, -1.0, -0.5], [-1.0, -0.2, -4.0]])
MASK = t([[1, 1, 1], [1, 1, 0]])


def test_k1_advantage_is_the_teachers_log_prob_minus_the_students_times_coef():
    advantages = reverse_kl_advantages(STUDENT, TEACHER, MASK, coef=0.5, estimator="k1")
    # t - s: [-1, 1, 0], [2, 0, -3 (masked)]; times 0.5
    torch.testing.assert_close(advantages, t([[-0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]))


def test_a_token_the_teacher_likes_more_gets_a_positive_k1_advantage():
    advantages = reverse_kl_advantages(STUDENT, TEACHER, MASK, coef=2.0, estimator="k1")
    teacher_prefers = (TEACHER > STUDENT) & MASK.bool()
    student_prefers = (TEACHER < STUDENT) & MASK.bool()
    assert (advantages[teacher_prefers] > 0).all() and teacher_prefers.any()
    assert (advantages[student_prefers] < 0).all() and student_prefers.any()


def test_k3_advantage_is_minus_schulmans_k3_times_coef():
    coef = 0.3
    advantages = reverse_kl_advantages(STUDENT, TEACHER, MASK, coef=coef, estimator="k3")
    # k3 with r = t / s: r - 1 - log r, from first principles on each token
    expected = [
        [-coef * (math.exp(tk - sk) - (tk - sk) - 1) * m for sk, tk, m in zip(s, tt, ms)]
        for s, tt, ms in zip(STUDENT.tolist(), TEACHER.tolist(), MASK.tolist())
    ]
    torch.testing.assert_close(advantages, t(expected), atol=ATOL, rtol=0)
    # s = -1, t = -2: t - s = -1, exp(-1) + 1 - 1 = 0.36788
    assert advantages[0, 0].item() == pytest.approx(-coef * 0.36788, abs=ATOL)
    # s = -2, t = -1: exp(1) - 1 - 1 = 0.71828
    assert advantages[0, 1].item() == pytest.approx(-coef * 0.71828, abs=ATOL)
    # k3 >= 0, so its advantage is <= 0 everywhere, and 0 where the two agree or off the mask
    assert (advantages <= 0).all()
    assert advantages[0, 2].item() == 0.0 and advantages[1, 2].item() == 0.0


def policy_and_kl_gradients(estimator: str):
    """Over every token of a small vocabulary, weighted by the student's probability: the
    expected policy gradient E_s[A(x) grad log s(x)] of the estimator's advantage, and the
    gradients of KL(student || teacher) and KL(teacher || student), all w.r.t. the student's
    logits."""
    generator = torch.Generator().manual_seed(3)
    student_logits = torch.randn(7, generator=generator, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(7, generator=generator), -1)
    student = torch.log_softmax(student_logits, -1)
    advantages = reverse_kl_advantages(
        student.detach(), teacher, torch.ones(7), coef=1.0, estimator=estimator
    )
    (policy_gradient,) = torch.autograd.grad(
        (student.detach().exp() * advantages * student).sum(), student_logits
    )
    student = torch.log_softmax(student_logits, -1)
    reverse_kl = (student.exp() * (student - teacher)).sum()
    forward_kl = (teacher.exp() * (teacher - student)).sum()
    (reverse_gradient,) = torch.autograd.grad(reverse_kl, student_logits, retain_graph=True)
    (forward_gradient,) = torch.autograd.grad(forward_kl, student_logits)
    return policy_gradient, reverse_gradient, forward_gradient


def test_k1s_advantage_follows_the_reverse_kls_gradient_in_expectation():
    """What distillation.mode=reverse_kl means to follow: minus grad KL(student || teacher)."""
    policy_gradient, reverse_gradient, _ = policy_and_kl_gradients("k1")
    torch.testing.assert_close(policy_gradient, -reverse_gradient, atol=ATOL, rtol=0)


def test_k3s_advantage_also_climbs_the_forward_kl_as_the_help_says():
    """k3 estimates the KL's value without bias, not its gradient: as an advantage its expected
    policy gradient is -grad KL(s || t) + grad KL(t || s) (the config help and README say so)."""
    policy_gradient, reverse_gradient, forward_gradient = policy_and_kl_gradients("k3")
    torch.testing.assert_close(
        policy_gradient, -reverse_gradient + forward_gradient, atol=ATOL, rtol=0
    )


def test_distill_metrics_are_per_token_means_over_the_response():
    metrics = distill_metrics(STUDENT, TEACHER, MASK)
    # s - t on the 5 real tokens: 1, -1, 0, -2, 0
    assert metrics["distill/reverse_kl"] == pytest.approx(-2 / 5)
    # -1 - 2 - 0.5 - 3 - 0.2
    assert metrics["distill/student_log_prob"] == pytest.approx(-6.7 / 5)
    # -2 - 1 - 0.5 - 1 - 0.2
    assert metrics["distill/teacher_log_prob"] == pytest.approx(-4.7 / 5)


# --- generalised JSD ------------------------------------------------------------------------


def seeded_logits(seed: int, shape=(3, 5, 11)):
    generator = torch.Generator().manual_seed(seed)
    student = 2 * torch.randn(*shape, generator=generator)
    teacher = 2 * torch.randn(*shape, generator=generator)
    mask = (torch.rand(shape[:2], generator=generator) > 0.3).float()
    mask[:, 0] = 1.0
    return student, teacher, mask


@pytest.fixture(scope="module")
def gkd_trainer():
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    pytest.importorskip("trl", minversion="1.16")
    from trl.experimental.gkd import GKDTrainer

    return GKDTrainer


@pytest.mark.parametrize("beta", BETAS)
def test_jsd_over_the_vocabulary_is_trls_loss_value_and_gradient(gkd_trainer, beta):
    student, teacher, mask = seeded_logits(0)
    keel_logits = student.clone().requires_grad_()
    trl_logits = student.clone().requires_grad_()
    keel_loss = masked_mean(generalized_jsd(keel_logits, teacher, beta), mask)
    # TRL ignores positions labelled -100, and means over the rest
    labels = torch.where(mask.bool(), 1, -100)
    trl_loss = gkd_trainer.generalized_jsd_loss(trl_logits, teacher, labels=labels, beta=beta)
    keel_loss.backward()
    trl_loss.backward()
    assert keel_loss.item() == pytest.approx(trl_loss.item(), abs=ATOL)
    assert torch.allclose(keel_logits.grad, trl_logits.grad, atol=1e-6)
    # both sides really differ: the loss is not 0 and the gradient moves the student
    assert keel_loss.item() > 0.01 and keel_logits.grad.abs().max() > 1e-4


def test_jsd_at_beta_0_is_forward_kl_and_at_beta_1_reverse_kl():
    student, teacher, _ = seeded_logits(1)
    s, q = torch.softmax(student, -1), torch.softmax(teacher, -1)
    # KL(p || q) = sum p (log p - log q), with probabilities, not log-probs
    teacher_student = (q * (q.log() - s.log())).sum(-1)
    student_teacher = (s * (s.log() - q.log())).sum(-1)
    torch.testing.assert_close(generalized_jsd(student, teacher, 0.0), teacher_student)
    torch.testing.assert_close(generalized_jsd(student, teacher, 1.0), student_teacher)
    # the two really differ here, so the test tells the directions apart
    assert (teacher_student - student_teacher).abs().max() > 0.1


def hand_jsd(student_probs, teacher_probs, beta):
    """JSD_beta from probabilities: beta KL(t || m) + (1 - beta) KL(s || m), m = beta t +
    (1 - beta) s; the two ends are TRL's plain KLs."""

    def kl(p, q):
        return (p * (p / q).log()).sum(-1)

    if beta == 0:
        return kl(teacher_probs, student_probs)
    if beta == 1:
        return kl(student_probs, teacher_probs)
    mixture = beta * teacher_probs + (1 - beta) * student_probs
    return beta * kl(teacher_probs, mixture) + (1 - beta) * kl(student_probs, mixture)


@pytest.mark.parametrize("beta", BETAS)
def test_jsd_over_the_teachers_top_k_renormalises_both_sides_there(beta):
    student, teacher, _ = seeded_logits(2)
    k = 4
    teacher_log_probs = torch.log_softmax(teacher, -1)
    student_log_probs = torch.log_softmax(student, -1)
    top = teacher_log_probs.topk(k, dim=-1)
    student_top = student_log_probs.gather(-1, top.indices)
    got = generalized_jsd(student_top, top.values, beta)
    # renormalised over the k tokens by hand: p / sum p
    teacher_probs = top.values.exp() / top.values.exp().sum(-1, keepdim=True)
    student_probs = student_top.exp() / student_top.exp().sum(-1, keepdim=True)
    torch.testing.assert_close(got, hand_jsd(student_probs, teacher_probs, beta))
    # not the full vocabulary's value
    assert (got - generalized_jsd(student, teacher, beta)).abs().max() > 1e-3


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("top_k", [None, 4])
def test_a_minus_infinite_student_logit_gives_finite_values_and_gradients(beta, top_k):
    clean, teacher, _ = seeded_logits(4, shape=(2, 3, 9))
    teacher_log_probs = torch.log_softmax(teacher, -1)
    # the teacher's favourite token at one position is impossible for the student
    student = clean.clone()
    student[0, 1, teacher_log_probs[0, 1].argmax()] = -math.inf

    def jsd_of(student_logits):
        student_log_probs = torch.log_softmax(student_logits, -1)
        if top_k is None:
            return generalized_jsd(student_log_probs, teacher_log_probs, beta)
        top = teacher_log_probs.topk(top_k, dim=-1)
        return generalized_jsd(student_log_probs.gather(-1, top.indices), top.values, beta)

    student = student.requires_grad_()
    jsd = jsd_of(student)
    jsd.sum().backward()
    assert torch.isfinite(jsd).all() and torch.isfinite(student.grad).all()
    # every other position keeps the value it has without the -inf
    others = torch.ones(2, 3, dtype=torch.bool)
    others[0, 1] = False
    torch.testing.assert_close(jsd.detach()[others], jsd_of(clean)[others])


def test_reverse_kl_ignores_a_token_the_student_cannot_sample():
    """beta 1, KL(s || t): a token of student probability 0 adds 0; the value is the sum over the
    others."""
    student, teacher, _ = seeded_logits(5, shape=(1, 1, 6))
    student[0, 0, 2] = -math.inf
    s, q = torch.softmax(student[0, 0], -1), torch.softmax(teacher[0, 0], -1)
    keep = torch.arange(6) != 2
    expected = (s[keep] * (s[keep].log() - q[keep].log())).sum()
    assert generalized_jsd(student, teacher, 1.0).item() == pytest.approx(expected.item(), abs=ATOL)
