"""Policy versions: how many actor updates a policy has had, and whether a batch was sampled from
the policy a step updates. Workers stamp each sample (each token, in a partial rollout) with theirs;
the driver's count is WorkerRoles.policy_version, saved with each checkpoint. `policy_version` is
what a step count gives, for checkpoints saved before the count was."""

from __future__ import annotations

from keel.config.schema import KeelConfig
from keel.config.trainer import OffPolicy
from keel.types import GeneratedBatch


def policy_version(cfg: KeelConfig, step: int) -> int:
    """The policy version after `step` steps: the actor updates so far (none before
    critic_warmup)."""
    return max(0, step - max(cfg.algorithm.critic_warmup, 1) + 1)


def sampled_by(off_policy: OffPolicy, batch: GeneratedBatch, version: int) -> bool:
    """Whether every sample of `batch` was sampled from policy `version` (the one the step updates):
    always when nothing runs ahead (sync), where each step trains what it generated."""
    if not off_policy.ahead or batch.policy_version is None:
        return True
    return bool((batch.policy_version == version).all())
