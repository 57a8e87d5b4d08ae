"""Policy versions: how many actor updates a policy has had, and whether a batch was sampled from the
policy a step updates. Workers stamp each sample (each token, in a partial rollout) with theirs."""

from __future__ import annotations

from keel.config.schema import KeelConfig
from keel.types import RolloutBatch


def policy_version(cfg: KeelConfig, step: int) -> int:
    """The policy version after `step` steps: the actor updates so far (none before critic_warmup)."""
    return max(0, step - max(cfg.algorithm.critic_warmup, 1) + 1)


def sampled_by(cfg: KeelConfig, batch: RolloutBatch, step: int) -> bool:
    """Whether every sample of `batch` was sampled from the policy step `step` updates: always in sync mode
    (a skipped step leaves the workers' count of updates behind the steps, never their weights)."""
    if cfg.trainer.mode == "sync" or batch.policy_version is None:
        return True
    return bool((batch.policy_version == policy_version(cfg, step - 1)).all())
