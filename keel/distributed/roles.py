"""How a rank builds the models of its roles: the policy (actor, its rollout engine and the agent
rollout around it, reference) and the critic, each loaded, wrapped with LoRA, compiled and sharded
as its section says; and how the engine takes the actor's weights after every update (EngineSync).
RoleWorker (worker.py) holds what they build."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from keel.distributed.fsdp import full_parameters
from keel.distributed.parallelize import parallelize
from keel.distributed.rollout_worker import Generator, generator_around
from keel.models.float8 import quantize_layers_float8, require_float8
from keel.models.load import can_compile, load_causal_lm, load_critic, resolve_dtype
from keel.models.lora import adapter_weights, apply_lora, frozen_base, plan_lora, trained_in_full
from keel.rollout.base import RolloutEngine
from keel.rollout.select import make_rollout_engine
from keel.training.actor import ActorTrainer, GKDLoss
from keel.training.batching import MicroBatching
from keel.training.critic import CriticTrainer
from keel.training.reference import AdapterlessReference, ReferencePolicy
from keel.training.teacher import Teacher

log = logging.getLogger("keel")


class EngineSync:
    """The engine sees the actor's updated weights: sharded, gathered a bucket of parameters per
    collective straight into the engine's own weights; with LoRA, only the adapters and what trains
    in full (the base never changes)."""

    def __init__(self, engine: RolloutEngine, lora: bool, sharded: bool, device: torch.device):
        self.engine, self.lora, self.sharded, self.device = engine, lora, sharded, device

    def push(self, actor_model) -> None:
        # an engine that generates with the module itself (hf) takes it whole
        if self.lora and self.engine.capabilities.load_adapters:
            self.engine.load_adapters(adapter_weights(actor_model))
            self.engine.load_weights(trained_in_full(actor_model), every=False)
        elif self.sharded:
            self.engine.load_weights(full_parameters(actor_model, self.device))
        else:
            self.engine.sync_weights(actor_model)


@dataclass
class PolicyRoles:
    """What a rank of the policy holds."""

    actor: ActorTrainer
    # the reference, when a KL term needs one
    ref: ReferencePolicy | AdapterlessReference | None
    # none on a rank whose rollout has workers of its own
    engine: RolloutEngine | None
    generator: Generator | None
    sync: EngineSync | None


class RoleBuilder:
    """Builds a rank's roles from its WorkerSpec; `sharding` gathers what each placement did."""

    def __init__(self, spec, world_size: int, device: torch.device, compute_dtype, tokenizer):
        self.spec, self.world_size, self.device = spec, world_size, device
        self.compute_dtype, self.tokenizer = compute_dtype, tokenizer
        self.lora = spec.policy.model.lora_rank > 0
        self.actor_sharded = world_size > 1 and spec.policy.actor.fsdp_config.fsdp_size != 1
        self.sharding: dict[str, float] = {}
        # the policy's engine, once built
        self.engine: RolloutEngine | None = None

    def policy(self, with_engine: bool, log_choice: bool) -> PolicyRoles:
        """The actor, its rollout engine (`with_engine`) and the reference (when a KL term needs
        one). `log_choice`: this rank logs which engine and why."""
        spec, policy = self.spec, self.spec.policy
        # every rank starts from identical weights
        torch.manual_seed(spec.seed)
        # With LoRA a checkpoint's actor is its adapters; the base is always model.path.
        weights = policy.model.path if self.lora else (spec.actor_weights or policy.model.path)
        model = load_causal_lm(
            weights,
            self.device,
            policy.model.trust_remote_code,
            policy.model.enable_gradient_checkpointing,
            # a frozen base
            dtype=self.compute_dtype if self.lora else torch.float32,
        )
        # Built before the actor is sharded (and before LoRA): it reads the whole base weights once.
        # After each update it takes the actor module's, gathered from shards; under LoRA it holds
        # the frozen base for the trainer too and takes only the adapters.
        if with_engine:
            self.engine = make_rollout_engine(
                policy.rollout,
                model,
                self.tokenizer,
                self.device,
                self.compute_dtype,
                log_choice=log_choice,
                will_be_sharded=self.actor_sharded,
                lora=self.lora,
            )
        if self.lora:
            model = self._with_adapters(
                model, policy.model, "actor_rollout_ref.model", spec.actor_weights
            )
            self._share_base(model, log_choice)
        return self._around_actor(model)

    def _around_actor(self, model) -> PolicyRoles:
        """The actor of `model`, the engine's sync and agent rollout, the reference."""
        spec, policy = self.spec, self.spec.policy
        model, placement = self._prepare_model(model, policy.actor.fsdp_config, "actor")
        actor = ActorTrainer(
            model,
            policy.actor,
            policy.rollout.temperature,
            spec.total_steps,
            log_prob_batching(policy.rollout),
            spec.max_response_length,
            placement,
            spec.rollout_correction,
            gkd_loss(spec.distillation),
        )
        engine, sync, generator = self.engine, None, None
        if engine is not None:
            sync = EngineSync(engine, self.lora, self.actor_sharded, self.device)
            # adapters loaded from a checkpoint or lora_adapter_path reach the engine now
            if self.lora:
                sync.push(actor.model)
            generator = generator_around(policy, engine, self.tokenizer, spec.max_response_length)
        return PolicyRoles(actor, self._reference(model, placement), engine, generator, sync)

    def _reference(self, model, placement):
        """The base itself with its adapters off under LoRA (no second model); else the starting
        policy, even on resume. None without a KL term."""
        spec, policy = self.spec, self.spec.policy
        if spec.with_reference and self.lora:
            return AdapterlessReference(
                model, log_prob_batching(policy.ref), policy.rollout.temperature, placement
            )
        if not spec.with_reference:
            return None
        ref_model = load_causal_lm(policy.model.path, self.device, policy.model.trust_remote_code)
        ref_model, placement = self._prepare_model(ref_model, policy.ref.fsdp_config, "ref")
        return ReferencePolicy(
            ref_model, log_prob_batching(policy.ref), policy.rollout.temperature, placement
        )

    def teacher(self) -> Teacher:
        """The distillation teacher: its own weights (never the student's base, LoRA or not),
        frozen in its dtype, compiled and sharded as the reference is."""
        distillation = self.spec.distillation
        t = distillation.teacher
        fsdp_cfg = self.spec.policy.ref.fsdp_config
        if t.dtype == "float8":
            model = float8_teacher(t, self.device)
            # whole on each worker: its float8 weights are buffers, which FSDP does not shard
            fsdp_cfg = dataclasses.replace(fsdp_cfg, fsdp_size=1)
        else:
            dtype = self.compute_dtype if t.dtype == "auto" else resolve_dtype(t.dtype, self.device)
            model = load_causal_lm(
                t.path, self.device, t.trust_remote_code, dtype=dtype, key=TEACHER_KEY
            )
        model, placement = self._prepare_model(model, fsdp_cfg, "teacher")
        return Teacher(
            model,
            log_prob_batching(t),
            self.spec.policy.rollout.temperature,
            distillation.gkd.top_k if distillation.mode == "gkd" else None,
            placement,
            student_vocab=student_vocab(self.spec.policy.model),
        )

    def critic(self) -> CriticTrainer:
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

    def _with_adapters(self, model, m, key: str, checkpoint: str | None = None):
        """peft's LoRA on a model by its section `m` (keel.models.lora: trap 7 is checked on the
        way), starting from a checkpoint's adapters, or a saved adapter (lora_adapter_path), or new
        ones."""
        plan = plan_lora(
            model, m.lora_rank, m.target_modules, m.exclude_modules, m.modules_to_save, key
        )
        adapters = checkpoint or m.lora_adapter_path
        return apply_lora(
            model, plan, m.lora_rank, m.lora_alpha, m.modules_to_save, self.compute_dtype, adapters
        )

    def _share_base(self, model, log_choice: bool) -> None:
        """One copy of the base: a whole (unsharded) LoRA policy's frozen weights become views of
        the native engine's decode weights. A sharded policy keeps its shard; the engine, the whole.
        (None here: the rollout's own workers hold their base.)"""
        engine = self.engine
        if engine is None or self.actor_sharded or not engine.capabilities.shares_frozen_weights:
            return
        freed = engine.share_frozen_weights(frozen_base(model))
        if log_choice:
            log.info(
                "LoRA: the trainer's frozen base is the rollout engine's weights (%.2f GB not "
                "copied)",
                freed / 1e9,
            )

    def _prepare_model(self, model, fsdp_cfg, role: str):
        """(the role's model made ready to train, its Placement): compiled (GPU), then sharded
        (several workers)."""
        compiled = self.spec.policy.actor.use_torch_compile and can_compile(self.device)
        # An engine that generates with this very module (hf, unsharded): its growing KV cache
        # would recompile the layers at every length, so they stay eager.
        generates_with_it = (
            role == "actor"
            and self.engine is not None
            and not self.engine.capabilities.owns_weights
        )
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


TEACHER_KEY = "distillation.teacher.path"


def float8_teacher(t, device: torch.device):
    """The teacher in bfloat16 with its decoder layers' matmuls in float8, or KEEL-M011 saying why
    that cannot run here."""
    require_float8(device)
    model = load_causal_lm(
        t.path, device, t.trust_remote_code, dtype=torch.bfloat16, key=TEACHER_KEY
    )
    return quantize_layers_float8(model)


def student_vocab(model_cfg) -> int:
    """The student's embedding rows, from its config (a teacher on a pool of its own has no student
    model to read them from)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(
        model_cfg.path, trust_remote_code=model_cfg.trust_remote_code
    ).vocab_size


def gkd_loss(distillation) -> GKDLoss | None:
    """The actor's distillation term: gkd's only (reverse_kl's is in the advantages)."""
    if distillation is None or distillation.mode != "gkd":
        return None
    return GKDLoss(beta=distillation.gkd.beta, coef=distillation.coef)


def log_prob_batching(role_cfg) -> MicroBatching:
    """Forward-only log-prob passes of the rollout (old log-probs) or the reference."""
    return MicroBatching.of(
        role_cfg.log_prob_micro_batch_size_per_gpu,
        role_cfg.log_prob_use_dynamic_bsz,
        role_cfg.log_prob_max_token_len_per_gpu,
    )
