"""Policy versions: how many actor updates a policy has had, and whether a batch was sampled from the
policy a step updates. Workers stamp each sample (each token, in a partial rollout) with theirs; the
driver's count is WorkerRoles.policy_version, saved with each checkpoint. `policy_version` is what a
step count gives, for checkpoints saved before the count was."""

from __future__ import annotations

from keel.config.schema import KeelConfig
from keel.types import GeneratedBatch


def policy_version(cfg: KeelConfig, step: int) -> int:
    """The policy version after `step` steps: the actor updates so far (none before critic_warmup)."""
    return max(0, step - max(cfg.algorithm.critic_warmup, 1) + 1)


def sampled_by(cfg: KeelConfig, batch: GeneratedBatch, version: int) -> bool:
    """Whether every sample of `batch` was sampled from policy `version` (the one the step updates):
    always in sync mode, where each step trains what it generated."""
    if cfg.trainer.mode == "sync" or batch.policy_version is None:
        return True
    return bool((batch.policy_version == version).all())
