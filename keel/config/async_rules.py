"""The rules of the off-policy value (trainer.mode=async, max_off_policy_steps, partial rollouts,
off_policy_strategy): what it needs, and what it cannot run with. The one place it is validated."""

from __future__ import annotations

from keel.config.schema import KeelConfig
from keel.errors.fixes import setting

ROLLOUT = "actor_rollout_ref.rollout"


def check_async(cfg: KeelConfig, incompatible) -> None:
    off = cfg.trainer.off_policy
    if off.partial and cfg.algorithm.adv_estimator == "remax":
        raise incompatible(
            "algorithm.adv_estimator=remax with trainer.partial_rollout=true: a group's samples "
            "span policy versions, and ReMax's greedy baseline comes from one policy, the one "
            "that sampled its batch",
            f"set {setting('trainer.partial_rollout', False)} (async mode generates each batch "
            "and its baseline with one policy), or another estimator (grpo, rloo)",
        )
    if off.ahead and cfg.algorithm.filter_groups.enable and not off.partial:
        raise incompatible(
            "algorithm.filter_groups.enable=true with trainer.mode=async and whole batches "
            "generated ahead: DAPO's dynamic sampling decides from their scores how many to "
            "generate, which is not known ahead",
            f"set {setting('trainer.partial_rollout', True)} (a step's rounds go on until enough "
            f"groups with a signal finished), or {setting('trainer.mode', 'sync')}",
        )
    if off.drop and not off.partial:
        raise incompatible(
            "trainer.off_policy_strategy=drop without trainer.partial_rollout: whole batches are "
            "generated at a known version and never pass max_off_policy_steps, so nothing would "
            "be dropped",
            f"set {setting('trainer.partial_rollout', True)}, or "
            f"{setting('trainer.off_policy_strategy', 'wait')}",
        )
    if off.partial:
        _check_partial(cfg, incompatible)


def _check_partial(cfg: KeelConfig, incompatible) -> None:
    off, rollout = cfg.trainer.off_policy, cfg.actor_rollout_ref.rollout
    if not off.ahead:
        raise incompatible(
            "trainer.partial_rollout=true with trainer.mode=sync: a sync step trains what it "
            "generated, so no sample goes on under the next policy",
            f"set {setting('trainer.mode', 'async')}, or "
            f"{setting('trainer.partial_rollout', False)}",
        )
    if off.bound == 0:
        raise incompatible(
            "trainer.partial_rollout=true with trainer.max_off_policy_steps=0: a sample cut by a "
            "weight update is trained at least one version after its first tokens",
            f"set {setting('trainer.max_off_policy_steps', 1)}, or "
            f"{setting('trainer.partial_rollout', False)}",
        )
    if rollout.name == "hf":
        raise incompatible(
            "trainer.partial_rollout=true with rollout.name=hf: transformers' generate cannot end "
            "a round part-way and continue its samples later; keel's native engine does",
            f"set {setting(ROLLOUT + '.name', 'native')} (or auto), or "
            f"{setting('trainer.partial_rollout', False)}",
        )
    if rollout.multi_turn.enable or rollout.agent.function or rollout.agent.environment:
        raise incompatible(
            "trainer.partial_rollout=true with a multi-turn or agent rollout: partial rollouts "
            "cut single-turn samples; an episode's turns, tools and agent code are not cut and "
            "continued yet",
            f"set {setting('trainer.partial_rollout', False)} (async mode still generates ahead)",
        )
