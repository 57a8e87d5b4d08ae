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

import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from keel.checkpoint import load_trainers, save_trainers
from keel.config.algorithm import RolloutCorrectionConfig
from keel.config.plan import Plan, plan_of
from keel.config.schema import ActorRolloutRefConfig, CriticConfig, KeelConfig
from keel.distributed.dist import init_process_group
from keel.distributed.fsdp import full_parameters
from keel.distributed.parallelize import parallelize
from keel.distributed.rollout_worker import (
    PolicyWeights,
    agent_around,
    continue_samples,
    generate_samples,
)
from keel.models.load import (
    autocast,
    can_compile,
    load_causal_lm,
    load_critic,
    load_tokenizer,
    quiet_transformers,
    resolve_device,
    resolve_dtype,
)
from keel.models.lora import adapter_weights, apply_lora, frozen_base, plan_lora, trained_in_full
from keel.observe.profile import RankProfile
from keel.rollout.agent import AgentLoop
from keel.rollout.agent.external import ExternalAgentRollout
from keel.rollout.base import RolloutEngine
from keel.rollout.hf import HFRolloutEngine
from keel.rollout.select import make_rollout_engine
from keel.training.actor import ActorTrainer
from keel.training.batching import MicroBatching, MiniBatch
from keel.training.critic import CriticTrainer
from keel.training.reference import AdapterlessReference, ReferencePolicy
from keel.types import GeneratedBatch, PartialSample, SamplingParams, ScoredBatch

log = logging.getLogger("keel")


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

    @classmethod
    def of(
        cls,
        cfg: KeelConfig,
        total_steps: int,
        actor_weights: str | None = None,
        roles: frozenset[str] | None = None,
        plan: Plan | None = None,
    ) -> WorkerSpec:
        """`roles` by default: the policy (without its engine when the rollout has a pool of its own),
        and the critic too unless it has a pool of its own. `plan`: keel's decisions (sharding,
        rollout correction); None: the config's own, as written."""
        plan = plan or plan_of(cfg)
        policy = "actor" if "rollout" in cfg.pools else "policy"
        colocated_critic = cfg.critic_enabled and "critic" not in cfg.pools
        t = cfg.trainer
        return cls(
            plan.policy(cfg),
            cfg.critic,
            roles or frozenset({policy, "critic"} if colocated_critic else {policy}),
            total_steps,
            t.device,
            t.seed,
            t.collective_timeout_s,
            cfg.data.max_response_length,
            cfg.ref_enabled,
            cfg.critic_batching[1],
            actor_weights,
            plan.rollout_correction,
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
        self.sharding: dict[str, float] = {}
        policy = spec.policy
        self.tokenizer = tokenizer or load_tokenizer(
            policy.model.path, policy.model.trust_remote_code
        )
        roles = spec.roles
        self.rollout: RolloutEngine | None = None
        # multi-turn: the loop that calls tools around the engine, or agent code through the
        # endpoint
        self.agent: AgentLoop | ExternalAgentRollout | None = None
        self.actor: ActorTrainer | None = None
        self.ref: ReferencePolicy | None = None
        # the policy version the engine's weights are: actor updates synced to it
        self.weights_version = 0
        if "policy" in roles or "actor" in roles:
            self._build_policy(with_engine="policy" in roles)
        self.critic = self._build_critic() if "critic" in roles else None

    def _build_policy(self, with_engine: bool) -> None:
        """The actor, its rollout engine (`with_engine`) and the reference (when a KL term needs one)."""
        spec, policy, rank = self.spec, self.spec.policy, self.rank
        # every rank starts from identical weights
        torch.manual_seed(spec.seed)
        # With LoRA a checkpoint's actor is its adapters; the base is always model.path.
        weights = policy.model.path if self.lora else (spec.actor_weights or policy.model.path)
        model = load_causal_lm(
            weights,
            self.device,
            policy.model.trust_remote_code,
            policy.model.enable_gradient_checkpointing,
            dtype=self.compute_dtype if self.lora else torch.float32,
            # a frozen base
        )
        # Built before the actor is sharded (and before LoRA): it reads the whole base weights once.
        # After each update it takes the actor module's, gathered from shards; under LoRA it holds
        # the frozen base for the trainer too and takes only the adapters.
        if with_engine:
            self.rollout = make_rollout_engine(
                policy.rollout,
                model,
                self.tokenizer,
                self.device,
                self.compute_dtype,
                log_choice=rank == 0,
                will_be_sharded=self._actor_sharded,
                lora=self.lora,
            )
        if self.lora:
            model = self._with_adapters(
                model, policy.model, "actor_rollout_ref.model", spec.actor_weights
            )
            self._share_base(model)
        model, placement = self._prepare_model(model, policy.actor.fsdp_config, "actor")
        self.actor = ActorTrainer(
            model,
            policy.actor,
            policy.rollout.temperature,
            spec.total_steps,
            _log_prob_batching(policy.rollout),
            spec.max_response_length,
            placement,
            spec.rollout_correction,
        )
        # adapters loaded from a checkpoint or lora_adapter_path reach the engine now
        if self.lora:
            self._sync_rollout()
        if with_engine:
            self.agent = agent_around(
                policy, self.rollout, self.tokenizer, spec.max_response_length
            )
        # the base itself, adapters off: no second model
        if spec.with_reference and self.lora:
            self.ref = AdapterlessReference(
                model, _log_prob_batching(policy.ref), policy.rollout.temperature, placement
            )
        # the reference is always the starting policy, even on resume
        elif spec.with_reference:
            ref_model = load_causal_lm(
                policy.model.path, self.device, policy.model.trust_remote_code
            )
            ref_model, placement = self._prepare_model(ref_model, policy.ref.fsdp_config, "ref")
            self.ref = ReferencePolicy(
                ref_model, _log_prob_batching(policy.ref), policy.rollout.temperature, placement
            )

    @property
    def lora(self) -> bool:
        return self.spec.policy.model.lora_rank > 0

    def _with_adapters(self, model, m, key: str, checkpoint: str | None = None):
        """peft's LoRA on a model by its section `m` (keel.models.lora: trap 7 is checked on the way),
        starting from a checkpoint's adapters, or a saved adapter (lora_adapter_path), or new ones."""
        plan = plan_lora(
            model, m.lora_rank, m.target_modules, m.exclude_modules, m.modules_to_save, key
        )
        adapters = checkpoint or m.lora_adapter_path
        return apply_lora(
            model, plan, m.lora_rank, m.lora_alpha, m.modules_to_save, self.compute_dtype, adapters
        )

    def _share_base(self, model) -> None:
        """One copy of the base: a whole (unsharded) LoRA policy's frozen weights become views of the
        native engine's decode weights. A sharded policy keeps its shard; the engine, the whole. (None
        here: the rollout's own workers hold their base.)"""
        if self.rollout is None or self._actor_sharded or isinstance(self.rollout, HFRolloutEngine):
            # hf generates with the module itself
            return
        freed = self.rollout.share_frozen_weights(frozen_base(model))
        if self.rank == 0:
            log.info(
                "LoRA: the trainer's frozen base is the rollout engine's weights (%.2f GB not copied)",
                freed / 1e9,
            )

    @property
    def _actor_sharded(self) -> bool:
        return self.world_size > 1 and self.spec.policy.actor.fsdp_config.fsdp_size != 1

    def _prepare_model(self, model, fsdp_cfg, role: str):
        """(the role's model made ready to train, its Placement): compiled (GPU), then sharded
        (several workers)."""
        compiled = self.spec.policy.actor.use_torch_compile and can_compile(self.device)
        # The hf engine generates with this very module when unsharded; its growing KV cache would
        # recompile the layers at every length, so they stay eager.
        # LoRA wraps it
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        generates_with_it = isinstance(self.rollout, HFRolloutEngine) and self.rollout.model is base
        model, placement, report = parallelize(
            model,
            role=role,
            device=self.device,
            world_size=self.world_size,
            compute_dtype=self.compute_dtype,
            fsdp_cfg=fsdp_cfg,
            compile_layers=compiled and not generates_with_it,
            fused_vocab=compiled,
        )
        self.sharding.update(report)
        return model, placement

    def _build_critic(self) -> CriticTrainer:
        spec, c = self.spec, self.spec.critic
        # the value head's initialisation, identical on every rank
        torch.manual_seed(spec.seed)
        # on the backbone; the value head trains in full
        lora = c.model.lora_rank > 0
        model = load_critic(
            c.model.path or spec.policy.model.path,
            self.device,
            spec.policy.model.trust_remote_code,
            dtype=self.compute_dtype if lora else torch.float32,
        )
        if lora:
            model.backbone = self._with_adapters(model.backbone, c.model, "critic.model")
        model, placement = self._prepare_model(model, c.model.fsdp_config, "critic")
        return CriticTrainer(model, c, spec.critic_micro_batch, spec.total_steps, placement)

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
        if hasattr(self.agent, "close"):
            self.agent.close()

    def info(self) -> dict:
        return {
            "rollout_engine": type(self.rollout).__name__ if self.rollout else None,
            **self.sharding,
        }

    def generate(
        self, prompts, sampling: SamplingParams, seed: int, on_finished=None
    ) -> tuple[GeneratedBatch | None, dict]:
        return generate_samples(
            self.agent or self.rollout, prompts, sampling, seed, self.weights_version, on_finished
        )

    def generate_round(
        self, samples: list[PartialSample], sampling: SamplingParams, seed: int, end
    ):
        return continue_samples(self.rollout, samples, sampling, seed, self.weights_version, end)

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
            if self._actor_sharded
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
        with autocast(self.device, self.compute_dtype):
            return self.actor.compute_log_probs(batch)

    def compute_ref_log_probs(self, batch: ScoredBatch) -> torch.Tensor:
        with autocast(self.device, self.compute_dtype):
            return self.ref.compute_log_probs(batch)

    def compute_values(self, batch: ScoredBatch) -> torch.Tensor:
        with autocast(self.device, self.compute_dtype):
            return self.critic.compute_values(batch)

    def update_actor(self, minis: list[MiniBatch]) -> dict[str, float]:
        with autocast(self.device, self.compute_dtype):
            metrics = self.actor.update(minis)
        start = time.perf_counter()
        self._sync_rollout()
        self.weights_version += 1
        metrics["timing_s/sync_rollout_weights"] = time.perf_counter() - start
        return metrics

    def update_critic(self, minis: list[MiniBatch]) -> dict[str, float]:
        with autocast(self.device, self.compute_dtype):
            return self.critic.update(minis)

    def _sync_rollout(self) -> None:
        """The engine sees the updated weights: sharded, gathered a bucket of parameters per
        collective straight into the engine's own weights. (None here: the rollout's own workers take
        them from policy_weights.)"""
        if self.rollout is None:
            return
        # hf generates with the module itself
        if self.lora and not isinstance(self.rollout, HFRolloutEngine):
            # the base never changes: never synced
            self.rollout.load_adapters(adapter_weights(self.actor.model))
            self.rollout.load_weights(trained_in_full(self.actor.model), every=False)
        elif self._actor_sharded:
            self.rollout.load_weights(full_parameters(self.actor.model, self.device))
        else:
            self.rollout.sync_weights(self.actor.model)

    # --- checkpoints -----------------------------------------------------------------------------
    def save(self, directory: str) -> None:
        save_trainers(
            Path(directory), self.actor, self.critic, self.rank, self.tokenizer, self._actor_sharded
        )

    def load(self, directory: str, weights_version: int = 0) -> None:
        """The checkpoint's optimisers and critic (the actor's weights came with the spec), and the
        policy version its weights are."""
        load_trainers(Path(directory), self.actor, self.critic)
        self.weights_version = weights_version


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def _log_prob_batching(role_cfg) -> MicroBatching:
    """Forward-only log-prob passes of the rollout (old log-probs) or the reference."""
    return MicroBatching.of(
        role_cfg.log_prob_micro_batch_size_per_gpu,
        role_cfg.log_prob_use_dynamic_bsz,
        role_cfg.log_prob_max_token_len_per_gpu,
    )
