"""The RL config's rules for the algorithm, rollout correction and reward: options that need or
exclude each other. Each raises the error `incompatible` makes (keel.config.rules passes it)."""

from __future__ import annotations

from keel.config.schema import GROUP_ESTIMATORS, KeelConfig
from keel.errors import BAD_VALUE, KeelError
from keel.errors.fixes import overrides, setting

ROLLOUT = "actor_rollout_ref.rollout"


def group_size(cfg: KeelConfig) -> int:
    """The smallest rollout.n of 2 or more whose mini-batches still split into micro-batches."""
    actor = cfg.actor_rollout_ref.actor
    fits = [
        n
        for n in range(2, 17)
        if actor.use_dynamic_bsz
        or actor.ppo_mini_batch_size * n % actor.ppo_micro_batch_size_per_gpu == 0
    ]
    return fits[0] if fits else 2


def check_algorithm(cfg: KeelConfig, incompatible) -> None:
    est, rollout = cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.rollout
    if cfg.algorithm.filter_groups.enable and rollout.n < 2:
        raise incompatible(
            f"algorithm.filter_groups.enable=true with actor_rollout_ref.rollout.n={rollout.n}: a "
            "group of one sample always looks alike, so every prompt would be dropped",
            f"set {setting(ROLLOUT + '.n', group_size(cfg))}",
        )
    if est in GROUP_ESTIMATORS and rollout.n < 2:
        raise incompatible(
            f"algorithm.adv_estimator={est} compares samples of the same prompt, but "
            f"actor_rollout_ref.rollout.n=1: every advantage would be 0 and nothing would learn",
            f"set {setting(ROLLOUT + '.n', group_size(cfg))} (GRPO typically uses 4-16)",
        )
    # where the rewards teach nothing (distillation alone) no advantage is estimated
    if est == "gae" and not cfg.critic_enabled and cfg.rewards_teach:
        raise incompatible(
            "algorithm.adv_estimator=gae needs a critic but critic.enable=false",
            f"set {setting('critic.enable', True)}, or `algorithm.adv_estimator=grpo`",
        )
    if est == "remax" and not rollout.do_sample:
        raise incompatible(
            "algorithm.adv_estimator=remax compares samples with a greedy baseline, but "
            "rollout.do_sample=false makes every sample the baseline: all advantages 0",
            f"set {setting(ROLLOUT + '.do_sample', True)}",
        )
    if cfg.algorithm.critic_warmup > 0 and not cfg.critic_enabled:
        raise incompatible(
            f"algorithm.critic_warmup={cfg.algorithm.critic_warmup} with no critic: the "
            "policy would not be updated for those steps",
            f"set {setting('algorithm.critic_warmup', 0)}",
        )


def check_rollout_correction(cfg: KeelConfig, incompatible) -> None:
    rc, key = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    try:
        rc.params()
    except ValueError as e:
        raise KeelError(
            BAD_VALUE,
            f"{key}: {e}",
            f"set {key}.rollout_rs to filters among token_k1..seq_max_k3 and rollout_rs_threshold "
            "to one bound each (k1: lower_upper), or "
            f"{overrides({key + '.rollout_rs': None, key + '.rollout_rs_threshold': None})} to "
            "reject nothing",
        ) from None
    if not (rc.bypass_mode or rc.decoupled):
        if rc.loss_type != "ppo_clip":
            raise incompatible(
                f"{key}.loss_type={rc.loss_type} without bypass_mode=true: the loss type is "
                "bypass mode's",
                f"set {setting(key + '.bypass_mode', True)}, or "
                f"{setting(key + '.loss_type', 'ppo_clip')}",
            )
        return
    if not cfg.actor_rollout_ref.rollout.do_sample:
        raise incompatible(
            f"{key} with rollout.do_sample=false: greedy engines record log-probs at temperature "
            "1, not the distribution the trainer computes",
            f"set {setting(ROLLOUT + '.do_sample', True)}",
        )
    loss_mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if rc.bypass_mode and loss_mode != "vanilla":
        raise incompatible(
            f"{key}.bypass_mode=true sets the policy loss (loss_type: PPO's clip or reinforce, as "
            f"verl's bypass mode does), but actor.policy_loss.loss_mode={loss_mode}",
            f"set {setting('actor_rollout_ref.actor.policy_loss.loss_mode', 'vanilla')}, or "
            f"{setting(key + '.bypass_mode', False)}",
        )
    if rc.bypass_mode and rc.rollout_is_batch_normalize:
        raise incompatible(
            f"{key}.rollout_is_batch_normalize with bypass_mode: bypass mode weighs each "
            "micro-batch as it trains, so the mean would be a micro-batch's and depend on how "
            "the batch is cut",
            f"set {setting(key + '.rollout_is_batch_normalize', False)}, or "
            f"{setting(key + '.bypass_mode', False)}",
        )
    if rc.bypass_mode and rc.loss_type == "ppo_clip" and rc.rollout_is is not None:
        raise incompatible(
            f"{key}.rollout_is with bypass_mode and loss_type=ppo_clip: the PPO ratio is already "
            "pi / pi_rollout, so verl computes these weights and never applies them",
            f"set {setting(key + '.rollout_is', None)}, or "
            f"{setting(key + '.loss_type', 'reinforce')} to weight -A log pi with them",
        )


def check_reward(cfg: KeelConfig, incompatible) -> None:
    if cfg.custom_reward_function.batched and (
        cfg.reward.scorers or not cfg.custom_reward_function.path
    ):
        raise incompatible(
            "custom_reward_function.batched=true needs custom_reward_function.path and no "
            "reward.scorers mapping: a batched function scores every sample itself",
            f"set {setting('custom_reward_function.batched', False)} (the function scores one "
            "sample a call), or set custom_reward_function.path and remove reward.scorers",
        )
    if cfg.reward_model.enable and not cfg.reward_model.model.path:
        raise incompatible(
            "reward_model.enable=true without reward_model.model.path",
            f"set {setting('reward_model.enable', False)} to score without a reward model, or set "
            "reward_model.model.path to a local sequence-classification model",
        )
    if cfg.reward_model.enable_resource_pool and not cfg.reward_model.enable:
        raise incompatible(
            "reward_model.enable_resource_pool=true with reward_model.enable=false: there is "
            "no reward model to place",
            f"set {setting('reward_model.enable_resource_pool', False)}",
        )
    overlong = cfg.reward.overlong_buffer
    if overlong.enable and overlong.len >= cfg.data.max_response_length:
        raise incompatible(
            f"reward.overlong_buffer.len={overlong.len} is not shorter than "
            f"data.max_response_length={cfg.data.max_response_length}: every response would be "
            "penalised",
            f"set {setting('reward.overlong_buffer.len', cfg.data.max_response_length // 4)} (a "
            "quarter of data.max_response_length)",
        )
