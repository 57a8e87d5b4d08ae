"""The run's worker groups: the policy's ranks, a critic pool, a rollout pool, a reward model pool.
Each is a RayGroup (placement group, phase timeout, dead-or-stalled diagnosis) serving the worker
its role builds."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from keel.distributed.dist import port_from_environment
from keel.distributed.group import RayGroup
from keel.distributed.ray_cluster import Devices
from keel.distributed.rollout_worker import RolloutWorker
from keel.distributed.worker import RoleWorker, WorkerSpec
from keel.rewards.model import RewardModel, RewardTemplate
from keel.training.batching import contiguous_shares

log = logging.getLogger("keel")

# the colocated roles every worker of the policy's group runs
POLICY_ROLE = "actor_rollout_ref"


def role_group(
    cfg,
    total_steps: int,
    actor_weights: str | None,
    stacks_dir: Path,
    roles: frozenset[str] | None = None,
    world_size: int | None = None,
    plan=None,
) -> RayGroup:
    """RoleWorkers on `world_size` ranks (the policy's workers by default). `roles`: what each
    builds (RoleWorker's default: the policy, and the critic when colocated); a critic pool is a
    second group with roles {"critic"} and a size of its own, whose rank 0 finds a port of its own
    (MASTER_PORT is the policy group's). `plan`: keel's decisions, as WorkerSpec.of takes them."""
    spec = WorkerSpec.of(cfg, total_steps, actor_weights, roles, plan)
    build = functools.partial(RoleWorker, spec)
    return RayGroup(
        build,
        world_size or cfg.world_size,
        Devices.of(cfg),
        role=",".join(sorted(roles)) if roles else POLICY_ROLE,
        stacks_dir=stacks_dir,
        phase_timeout_s=cfg.trainer.guards.phase_timeout_s,
        port=port_from_environment() if roles is None else None,
    )


def rollout_group(
    cfg, total_steps: int, actor_weights: str | None, stacks_dir: Path, plan=None
) -> RayGroup:
    """The rollout's own workers (actor_rollout_ref.hybrid_engine=false): RolloutWorkers on
    rollout.n_gpus_per_node x rollout.nnodes devices, generating independently (no process
    group)."""
    spec = WorkerSpec.of(cfg, total_steps, actor_weights, plan=plan)
    build = functools.partial(RolloutWorker, spec)
    return RayGroup(
        build,
        cfg.pools["rollout"],
        Devices.of(cfg),
        role="rollout",
        stacks_dir=stacks_dir,
        phase_timeout_s=cfg.trainer.guards.phase_timeout_s,
        rendezvous=False,
    )


class RewardModelReplica:
    """One copy of the reward model in its own process (Ray shows it only its own GPU)."""

    def __init__(self, rm_cfg, use_gpu: bool, rank: int = 0, world_size: int = 1, master=None):
        self.device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
        self.model = RewardModel(
            rm_cfg.model.path,
            self.device,
            rm_cfg.micro_batch_size_per_gpu,
            rm_cfg.max_length,
            rm_cfg.model.trust_remote_code,
        )

    def score(self, raw_prompts: list, responses: list[str]) -> list[float | str]:
        return self.model.score(raw_prompts, responses)


class RewardModelPool(RewardTemplate):
    """`reward_model.enable_resource_pool`: `reward_model.n_gpus_per_node x nnodes` replicas on
    devices of their own, each scoring a contiguous share of the batch. The policy's workers are
    placed first and the pool takes other devices, so a large reward model does not compete with
    the actor's memory. `score` is RewardModel's, so the reward function does not know the
    difference."""

    def __init__(self, rm_cfg, devices: Devices, stacks_dir: Path, phase_timeout_s: float | None):
        # for `keel check`
        super().__init__(rm_cfg.model.path, rm_cfg.max_length, rm_cfg.model.trust_remote_code)
        count = devices.pools["reward model"]
        build = functools.partial(RewardModelReplica, rm_cfg, devices.gpus)
        self.group = RayGroup(
            build,
            count,
            devices,
            role="reward_model",
            stacks_dir=stacks_dir,
            phase_timeout_s=phase_timeout_s,
            rendezvous=False,
        )
        log.info("reward model: %d replicas on %ss of their own", count, devices.resource)

    @classmethod
    def of(cls, cfg) -> RewardModelPool:
        return cls(
            cfg.reward_model, Devices.of(cfg), Path(cfg.run_dir), cfg.trainer.guards.phase_timeout_s
        )

    @property
    def replicas(self) -> list:
        return self.group.actors

    def score(self, raw_prompts: list, responses: list[str]) -> list[float | str]:
        """Every replica scores a contiguous share; the scores come back in order."""
        shares = contiguous_shares(len(responses), self.group.world_size)
        parts = self.group.call(
            "score", [(raw_prompts[start:end], responses[start:end]) for start, end in shares]
        )
        return [score for part in parts for score in part]

    def shutdown(self) -> None:
        self.group.shutdown()
