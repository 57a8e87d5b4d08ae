"""The reward's sections of the RL config: scorers and their shaping, the reward service, the code
sandbox, the reward model and a custom reward function (verl's custom_reward_function)."""

from __future__ import annotations

from dataclasses import dataclass

from keel.config.fields import ResourcePool, opt


@dataclass
class OverlongBufferConfig:
    enable: bool = opt(False, help="DAPO's soft overlong punishment (arXiv 2503.14476)")
    len: int = opt(64, gt=0, help="the last `len` tokens before max_response_length are penalised")
    penalty_factor: float = opt(1.0, ge=0, help="penalty at max_response_length")


@dataclass
class RewardNormConfig:
    enable: bool = opt(False, help="running mean/std normalisation of scores")
    window_size: int = opt(1000, gt=1, help="scores the mean and std are taken over")
    eps: float = opt(1e-6, gt=0)
    clip: float | None = opt(5.0, gt=0, help="clip z-scores to [-clip, clip]; null: no clip")


@dataclass
class RewardServiceConfig:
    url: str | None = opt(
        None, help="a keel reward-server, e.g. http://127.0.0.1:8000; scores every sample"
    )
    timeout_s: float = opt(30.0, gt=0, help="per request")
    retry_times: int = opt(3, ge=0)
    retry_delay_s: float = opt(1.0, ge=0, help="doubles after each retry")
    token: str | None = opt(None, help="bearer token, if the server wants one")


@dataclass
class SandboxConfig:
    require: str = opt(
        "isolation",
        choices=("isolation", "all", "none"),
        help="what model-written code (code_exec) needs of the jail: its isolation (own filesystem "
        "view, no network, own pid namespace, an unprivileged user), every protection keel doctor "
        "lists, or none (run with what there is, warned)",
    )


@dataclass
class RewardConfig:
    scorers: dict[str, dict[str, float]] = opt(
        factory=dict,
        help="data_source -> {scorer: weight}, e.g. {gsm8k: {gsm8k: 0.9, think_answer_format: "
        "0.1}}; sources not listed use the built-in dispatch",
    )
    overlong_buffer: OverlongBufferConfig = opt(factory=OverlongBufferConfig)
    normalize: RewardNormConfig = opt(factory=RewardNormConfig)
    service: RewardServiceConfig = opt(factory=RewardServiceConfig)
    sandbox: SandboxConfig = opt(factory=SandboxConfig)
    on_error: str = opt(
        "mask",
        choices=("mask", "zero", "raise"),
        help="a sample the scorer fails on: left out of the update, scored 0, or stop",
    )
    max_not_scored_ratio: float = opt(
        0.1, ge=0, le=1, help="stop when a batch has more not-scored samples"
    )
    timeout_s: float | None = opt(30.0, gt=0, help="per-sample scoring time limit")
    num_workers: int = opt(0, ge=0, help="scoring processes; 0 scores in the trainer's process")
    score_ahead: bool = opt(
        True,
        help="with num_workers > 0: each sample begins scoring as soon as it finishes, beside the "
        "rest's generation (keel's native engine and agent loop, in any worker layout, and "
        "partial rollouts)",
    )


@dataclass
class RewardModelPathConfig:
    path: str | None = opt(None, help="local sequence-classification model (num_labels=1)")
    trust_remote_code: bool = opt(False)


@dataclass
class RewardModelConfig(ResourcePool):
    enable: bool = opt(
        False, help="score with a reward model (all data_sources, unless reward.scorers maps them)"
    )
    model: RewardModelPathConfig = opt(factory=RewardModelPathConfig)
    micro_batch_size_per_gpu: int = opt(16, gt=0)
    max_length: int | None = opt(
        None, gt=0, help="tokens it reads; default: its max_position_embeddings"
    )


@dataclass
class CustomRewardConfig:
    path: str | None = opt(None, help="python file defining the reward function")
    name: str = opt("compute_score")
    batched: bool = opt(
        False,
        help="the function takes lists (data_sources, solution_strs, ground_truths, "
        "extra_infos) and returns a list of scores",
    )
    reward_kwargs: dict = opt(
        factory=dict, help="keyword arguments passed to the function on every call, as verl"
    )
