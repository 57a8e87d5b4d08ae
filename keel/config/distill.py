"""On-policy distillation's section: the teacher, and how the student learns from it.

The student samples (keel's RL loop, unchanged); a frozen teacher scores the sampled tokens; the
student learns either from the teacher's log-prob of each sampled token as a per-token advantage
(`reverse_kl`, Thinking Machines' and verl's on-policy distillation) or from the generalised
Jensen-Shannon divergence to the teacher's top-k distribution at every position (`gkd`, Agarwal et
al. 2023; TRL's GKDTrainer)."""

from __future__ import annotations

from dataclasses import dataclass

from keel.config.fields import LogProbBatching, ResourcePool, opt

DISTILL_MODES = ("reverse_kl", "gkd")
TEACHER_DTYPES = ("auto", "bfloat16", "float32", "float8")
# k1 and k3 (and their verl names): each advantage's expected gradient is known (the help says
# which); abs and k2 (mse) follow no divergence's, so the run would learn something unsaid
REVERSE_KL_ESTIMATORS = ("k1", "k3", "kl", "low_var_kl")


@dataclass
class TeacherConfig(LogProbBatching, ResourcePool):
    path: str = opt(
        "", help="local Hugging Face causal LM directory; its tokenizer must be the student's"
    )
    dtype: str = opt(
        "auto",
        choices=TEACHER_DTYPES,
        help="the frozen teacher's weights; auto: the student's compute dtype (bfloat16 on GPU, "
        "float32 on CPU); float8: its decoder layers' matmuls in float8 with a scale per row "
        "(GPUs of compute capability 8.9 or later), the rest in bfloat16, the teacher "
        "whole on each worker",
    )
    trust_remote_code: bool = opt(False)


@dataclass
class GKDConfig:
    beta: float = opt(
        0.5,
        ge=0,
        le=1,
        help="generalised JSD's interpolation: 0 forward KL(teacher||student), 1 reverse "
        "KL(student||teacher) (TRL's GKDConfig.beta)",
    )
    lmbda: float = opt(
        1.0,
        ge=0,
        le=1,
        help="share of steps trained on the student's own samples; the rest train on the data's "
        "responses (distillation.response_key), drawn per step. TRL's GKDConfig.lmbda",
    )
    top_k: int = opt(
        64,
        gt=0,
        help="teacher tokens kept per position; both distributions are renormalised over them "
        "(memory: samples x response tokens x top_k x 12 bytes on the host)",
    )


@dataclass
class DistillationConfig:
    enable: bool = opt(False, help="learn from distillation.teacher")
    mode: str = opt(
        "reverse_kl",
        choices=DISTILL_MODES,
        help="reverse_kl: the teacher's log-prob minus the student's, per sampled token, is the "
        "advantage (policy-gradient update); gkd: the generalised JSD to the teacher's top-k is "
        "the loss",
    )
    teacher: TeacherConfig = opt(factory=TeacherConfig)
    coef: float = opt(1.0, gt=0, help="weight of the distillation term")
    kl_estimator: str = opt(
        "k1",
        choices=REVERSE_KL_ESTIMATORS,
        help="reverse_kl: the per-token estimate of KL(student||teacher) the advantage is minus "
        "of: k1 = log s - log t, whose policy gradient is the reverse KL's; k3 = t/s - 1 - "
        "log(t/s), lower variance, but as an advantage its expected gradient also climbs "
        "KL(teacher||student)",
    )
    task_reward_coef: float = opt(
        0.0,
        ge=0,
        help="weight of the reward function's advantage beside the distillation term; 0: "
        "distillation alone (rewards are still scored and logged)",
    )
    gkd: GKDConfig = opt(factory=GKDConfig)
    response_key: str = opt(
        "response",
        help="gkd with lmbda < 1: the column holding each prompt's reference response",
    )
