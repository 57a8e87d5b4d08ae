"""The `algorithm` section: advantages, KL in the reward, dynamic sampling, rollout correction."""

from __future__ import annotations

from dataclasses import dataclass

from keel.algorithms.advantages import ADV_ESTIMATORS as ESTIMATOR_REGISTRY
from keel.algorithms.kl import KL_ESTIMATORS as KL_TYPES
from keel.algorithms.rollout_correction import (
    IS_LEVELS,
    RS_OPTIONS,
    CorrectionParams,
    parse_rejection,
)
from keel.config.fields import opt

# The algorithms' registries are the one source of what a key may name.
ADV_ESTIMATORS = tuple(ESTIMATOR_REGISTRY)
GROUP_ESTIMATORS = tuple(
    name for name, estimator in ESTIMATOR_REGISTRY.items() if estimator.needs_group
)


@dataclass
class KLControlConfig:
    type: str = opt("fixed", choices=("fixed", "adaptive"))
    kl_coef: float = opt(0.001, ge=0)
    target_kl: float = opt(0.1, gt=0)
    horizon: int = opt(10000, gt=0)


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (arXiv 2503.14476): prompts whose samples all scored alike carry no
    group-relative signal; they are dropped and more prompts generated until the batch is full."""

    enable: bool = opt(False)
    metric: str = opt(
        "acc",
        choices=("acc", "score", "seq_reward", "seq_final_reward"),
        help="what must differ within a group: acc (the reward function's `acc`, else the score), "
        "score / seq_reward (the score), seq_final_reward (the score; KL in the reward is "
        "not subtracted yet when groups are judged)",
    )
    max_num_gen_batches: int = opt(
        10, ge=0, help="generation batches per step at most (0: no limit); past it KEEL-T005"
    )


@dataclass
class RolloutCorrectionConfig:
    """verl's rollout correction: the sampler's log-probs against the trainer's, as importance
    weights and rejection (keel.algorithms.rollout_correction)."""

    rollout_is: str | None = opt(
        None,
        choices=IS_LEVELS,
        help="truncated importance weights pi_old / "
        "pi_rollout on the policy loss, per token or per sequence (null: none)",
    )
    rollout_is_threshold: float = opt(2.0, gt=0, help="the weights are truncated at this value")
    rollout_is_batch_normalize: bool = opt(
        False, help="rescale the weights to mean 1 over the batch"
    )
    rollout_rs: str | None = opt(
        None,
        help="rejection: comma-separated filters on the ratio ("
        f"{', '.join(RS_OPTIONS)}); rejected tokens leave the losses",
    )
    rollout_rs_threshold: str | None = opt(
        None,
        help="one bound for every rollout_rs filter or one each, "
        "comma-separated; a k1 filter takes lower_upper ratio bounds",
    )
    bypass_mode: bool = opt(
        False,
        help="the sampler's log-probs are the old policy's: no old-log-prob pass, "
        "and the filters run in the update against the current policy",
    )
    loss_type: str = opt(
        "ppo_clip",
        choices=("ppo_clip", "reinforce"),
        help="bypass_mode's loss: PPO's clip (the ratio is pi/pi_rollout), or -A log pi with "
        "rollout_is weights",
    )

    def params(self) -> CorrectionParams:
        """The algorithm's parameters; ValueError when rollout_rs or its threshold is malformed."""
        return CorrectionParams(
            self.rollout_is,
            self.rollout_is_threshold,
            self.rollout_is_batch_normalize,
            parse_rejection(self.rollout_rs, self.rollout_rs_threshold),
        )

    @property
    def decoupled(self) -> bool:
        """Weights and rejection computed once per batch, from the recomputed old log-probs."""
        return not self.bypass_mode and (self.rollout_is is not None or self.rollout_rs is not None)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = opt("gae", choices=ADV_ESTIMATORS)
    gamma: float = opt(1.0, ge=0, le=1)
    lam: float = opt(1.0, ge=0, le=1)
    norm_adv_by_std_in_grpo: bool = opt(True, help="false gives Dr. GRPO")
    use_kl_in_reward: bool = opt(False)
    kl_penalty: str = opt("kl", choices=KL_TYPES, help="KL estimator in the reward")
    kl_ctrl: KLControlConfig = opt(factory=KLControlConfig)
    critic_warmup: int = opt(
        0,
        ge=0,
        help="the actor is updated from this step on, as verl counts: N trains the critic alone "
        "for N - 1 steps",
    )
    filter_groups: FilterGroupsConfig = opt(factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = opt(factory=RolloutCorrectionConfig)
