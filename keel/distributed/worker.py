"""One SPMD rank of the roles it is given: the policy (actor, rollout, reference) and the critic.

By default a rank holds both, as verl's ActorRolloutRefWorker with the critic sharing its GPUs;
with critic.enable_resource_pool the critic is a second group of these workers, built with
roles={"critic"} and ranks of its own. The driver calls it with this rank's part of each batch
(keel.distributed.serving runs the calls); with one worker it lives in the driver's own process.
With more, each worker is a torch.distributed rank whose models keel.distributed.parallelize
shards with FSDP2 (or, fsdp_size=1, replicates), and its rollout engine generates from whole
weights it takes after every update: read from the unsharded module, or gathered from the shards.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from keel.checkpoint import load_trainers, save_trainers
from keel.config.algorithm import RolloutCorrectionConfig
from keel.config.distill import DistillationConfig
from keel.config.plan import Plan, plan_of
from keel.config.schema import ActorRolloutRefConfig, CriticConfig, KeelConfig
from keel.distributed.dist import init_process_group
from keel.distributed.fsdp import full_parameters
from keel.distributed.roles import EngineSync, RoleBuilder
from keel.distributed.rollout_worker import (
    Generator,
    PolicyWeights,
    continue_samples,
    generate_samples,
)
from keel.models.load import (
    autocast,
    load_tokenizer,
    quiet_transformers,
    resolve_device,
    resolve_dtype,
)
from keel.models.lora import adapter_weights, trained_in_full
from keel.observe.profile import RankProfile
from keel.rollout.base import RolloutEngine
from keel.rollout.native.scoring import score as invariant_score
from keel.training.actor import ActorTrainer
from keel.training.batching import MiniBatch
from keel.training.reference import AdapterlessReference, ReferencePolicy
from keel.types import GeneratedBatch, PartialSample, SamplingParams, ScoredBatch


@dataclass(frozen=True)
class WorkerSpec:
    """What a rank builds, cut from the config once: the sections it reads, and the few numbers
    the rest of the config decides."""

    # the policy's model, actor, rollout and reference
    policy: ActorRolloutRefConfig
    critic: CriticConfig
    # "policy" (actor, rollout engine, reference), "actor" (the policy without its engine: the
    # rollout has workers of its own), "critic"
    roles: frozenset[str]
    # the LR schedules' length
    total_steps: int
    # trainer.device
    device: str
    # trainer.seed: identical initial weights on every rank
    seed: int
    collective_timeout_s: float
    # seq-mean-token-sum-norm's constant
    max_response_length: int
    # a KL term needs the reference
    with_reference: bool
    # critic.ppo_micro_batch_size_per_gpu, or the actor's
    critic_micro_batch: int
    # a checkpoint's actor to start from instead of the model path
    actor_weights: str | None
    # algorithm.rollout_correction
    rollout_correction: RolloutCorrectionConfig | None = None
    # the distillation section, where a teacher is built ("teacher" in roles)
    distillation: DistillationConfig | None = None

    @classmethod
    def of(
        cls,
        cfg: KeelConfig,
        total_steps: int,
        actor_weights: str | None = None,
        roles: frozenset[str] | None = None,
        plan: Plan | None = None,
    ) -> WorkerSpec:
        """`roles` by default: the policy (without its engine when the rollout has a pool of its
        own), and the critic too unless it has a pool of its own. `plan`: keel's decisions
        (sharding, rollout correction); None: the config's own, as written."""
        plan = plan or plan_of(cfg)
        policy = "actor" if "rollout" in cfg.pools else "policy"
        colocated_critic = cfg.critic_enabled and "critic" not in cfg.pools
        colocated_teacher = cfg.teacher_enabled and "teacher" not in cfg.pools
        default_roles = {policy} | ({"critic"} if colocated_critic else set())
        t = cfg.trainer
        return cls(
            plan.policy(cfg),
            cfg.critic,
            roles or frozenset(default_roles | ({"teacher"} if colocated_teacher else set())),
            total_steps,
            t.device,
            t.seed,
            t.collective_timeout_s,
            cfg.data.max_response_length,
            cfg.ref_enabled,
            cfg.critic_batching[1],
            actor_weights,
            plan.rollout_correction,
            cfg.distillation if cfg.teacher_enabled else None,
        )


class RoleWorker:
    def __init__(
        self,
        spec: WorkerSpec,
        rank: int = 0,
        world_size: int = 1,
        master: tuple[str, int] | None = None,
        tokenizer=None,
    ):
        quiet_transformers()
        self.spec, self.rank, self.world_size = spec, rank, world_size
        self.device = resolve_device(spec.device)
        # NCCL wants an index; a Ray worker sees only its own GPU
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.compute_dtype = resolve_dtype(spec.policy.model.dtype, self.device)
        if world_size > 1:
            init_process_group(rank, world_size, *master, self.device, spec.collective_timeout_s)
        policy = spec.policy
        self.tokenizer = tokenizer or load_tokenizer(
            policy.model.path, policy.model.trust_remote_code
        )
        build = RoleBuilder(spec, world_size, self.device, self.compute_dtype, self.tokenizer)
        self.lora, self.actor_sharded, self.sharding = (
            build.lora,
            build.actor_sharded,
            build.sharding,
        )
        # the policy's parts: the actor, its engine (and what drives it through multi-turn or agent
        # rollouts) and the reference
        self.engine: RolloutEngine | None = None
        self.generator: Generator | None = None
        self.sync: EngineSync | None = None
        self.actor: ActorTrainer | None = None
        self.ref: ReferencePolicy | AdapterlessReference | None = None
        # the policy version the engine's weights are: actor updates synced to it
        self.weights_version = 0
        if "policy" in spec.roles or "actor" in spec.roles:
            built = build.policy(with_engine="policy" in spec.roles, log_choice=rank == 0)
            self.actor, self.ref, self.engine = built.actor, built.ref, built.engine
            self.generator, self.sync = built.generator, built.sync
        self.critic = build.critic() if "critic" in spec.roles else None
        self.teacher = build.teacher() if "teacher" in spec.roles else None

    # --- what the driver calls ------------------------------------------------------------------
    def start_profile(self) -> None:
        """`keel bench --profile`: this rank's work under torch.profiler until stop_profile."""
        self._profile = RankProfile(self.device)

    def stop_profile(self, path: str | None) -> dict[str, dict[str, float]]:
        """Ends the profile; rank 0 writes its kernel and phase table to `path`. Returns how busy
        this rank's GPU was in each phase (RankProfile.stop)."""
        busy = self._profile.stop(path if self.rank == 0 else None)
        self._profile = None
        return busy

    def close(self) -> None:
        """Processes the worker started (an agent rollout's endpoint and agents) stop."""
        if self.generator is not None:
            self.generator.close()

    def info(self) -> dict:
        return {
            "rollout_engine": type(self.engine).__name__ if self.engine else None,
            # the engine's KV cache and CUDA graphs kept between steps (native engine only)
            "kv_cache_kept": getattr(self.engine, "keeps_cache_now", None),
            # the actor's weights into this rank's engine device to device, in place; a rollout
            # on workers of its own takes them through the host (policy_weights)
            "weight_sync": "in place on the device" if self.sync is not None else None,
            **self.sharding,
        }

    def generate(
        self, prompts, sampling: SamplingParams, seed: int, on_finished=None
    ) -> tuple[GeneratedBatch | None, dict]:
        return generate_samples(
            self.generator, prompts, sampling, seed, self.weights_version, on_finished
        )

    def generate_round(
        self, samples: list[PartialSample], sampling: SamplingParams, seed: int, end
    ):
        return continue_samples(self.engine, samples, sampling, seed, self.weights_version, end)

    def policy_weights(self) -> tuple[PolicyWeights | None, int]:
        """(the actor's weights on the host, on rank 0: whole, or with LoRA its adapters; its policy
        version): for a rollout on workers of its own. Every rank takes part (a sharded actor's
        weights are gathered)."""
        if self.lora:
            adapters = [
                (name, _on_host(a), _on_host(b)) for name, a, b in adapter_weights(self.actor.model)
            ]
            named = [(name, _on_host(tensor)) for name, tensor in trained_in_full(self.actor.model)]
            return (
                PolicyWeights(named, adapters) if self.rank == 0 else None
            ), self.weights_version
        named = (
            full_parameters(self.actor.model, self.device)
            if self.actor_sharded
            else self.actor.model.named_parameters()
        )
        # its part of each gather, none of it kept
        if self.rank != 0:
            deque(named, maxlen=0)
            return None, self.weights_version
        return PolicyWeights(
            [(name, _on_host(tensor)) for name, tensor in named]
        ), self.weights_version

    def compute_log_probs(self, batch: ScoredBatch) -> torch.Tensor:
        # rollout.batch_invariant: the engine's prefill of each whole sequence, in the sampler's
        # arithmetic, from the policy's current weights (synced to it after every update)
        if self.spec.policy.rollout.batch_invariant:
            return invariant_score(self.engine, batch, self.actor.temperature)
        with autocast(self.device, self.compute_dtype):
            return self.actor.compute_log_probs(batch)

    def compute_frozen(self, role: str, batch: ScoredBatch):
        """A frozen model's pass over this rank's part of a batch: the reference's log-probs
        [n, R] ("ref"), or the distillation teacher's scores (TeacherScores' parts, "teacher")."""
        if role == "ref":
            with autocast(self.device, self.compute_dtype):
                return self.ref.compute_log_probs(batch)
        # the teacher computes in its own dtype (distillation.teacher.dtype): a float32 teacher
        # beside a bfloat16 student would otherwise pay float32's memory for bfloat16's numbers
        with autocast(self.device, self.teacher.model.dtype):
            return self.teacher.score(batch).parts()

    def compute_values(self, batch: ScoredBatch) -> torch.Tensor:
        with autocast(self.device, self.compute_dtype):
            return self.critic.compute_values(batch)

    def update_actor(self, minis: list[MiniBatch]) -> dict[str, float]:
        with autocast(self.device, self.compute_dtype):
            metrics = self.actor.update(minis)
        start = time.perf_counter()
        # none here: the rollout's own workers take the weights from policy_weights
        if self.sync is not None:
            self.sync.push(self.actor.model)
        self.weights_version += 1
        metrics["timing_s/sync_rollout_weights"] = time.perf_counter() - start
        return metrics

    def update_critic(self, minis: list[MiniBatch]) -> dict[str, float]:
        with autocast(self.device, self.compute_dtype):
            return self.critic.update(minis)

    # --- checkpoints -----------------------------------------------------------------------------
    def save(self, directory: str) -> None:
        save_trainers(
            Path(directory), self.actor, self.critic, self.rank, self.tokenizer, self.actor_sharded
        )

    def load(self, directory: str, weights_version: int = 0) -> None:
        """The checkpoint's optimisers and critic (the actor's weights came with the spec), and the
        policy version its weights are."""
        load_trainers(Path(directory), self.actor, self.critic)
        self.weights_version = weights_version


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)
