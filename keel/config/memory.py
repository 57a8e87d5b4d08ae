"""The memory a run needs on each device, estimated from its config and its model's architecture
(`keel check` compares it with what the device has)."""

from __future__ import annotations

from keel.config.schema import FSDPConfig, KeelConfig


def estimate_memory_gb(
    cfg: KeelConfig,
    model_cfg,
    params: int,
    *,
    compute_bytes: int,
    native_rollout: bool,
    logits_chunk_tokens: int,
    lora_trainable: dict[str, int] | None = None,
    actor_fsdp: FSDPConfig | None = None,
    teacher: tuple[int, int] | None = None,
) -> dict[str, float]:
    """Per-device estimate for a policy of `params` parameters. float32 master weights (4 B) +
    gradients (4 B) + AdamW moments (8 B) for each trained model, divided among the ranks FSDP
    shards them over (and off the device when offloaded); 4 B per weight for the frozen reference;
    with more than one worker, the rollout hf engine's whole float32 copy of the policy; activations
    of one micro-batch (about 34 bytes x hidden per token per layer, Korthikanti et al. arXiv
    2205.05198, plus one chunk's float32 logits); the KV cache of one generation batch and, for the
    native engine, its decode weights. A critic with a pool of its own is estimated for its own
    devices, as `critic_pool`, outside the total, a rollout's own (hybrid_engine=false) as
    `rollout_pool`, a distillation teacher's (`teacher`: parameters, its dtype's bytes) as
    `teacher_pool`, else as `teacher` in the total (frozen, sharded as the reference is).

    What the config alone does not say comes from the caller: the compute dtype's size on the
    device the run resolves to, whether the native engine runs this architecture, how many
    positions' logits the log-prob pass holds at once, and the actor's fsdp_config as the run
    applies it (`actor_fsdp`: the plan's sharding; the config's by default). With LoRA
    (`lora_trainable`: the trainable parameters of each role that has it, "actor" or "critic"), the
    frozen base is in the compute dtype with no gradients or optimiser state, the reference is that
    same base, and on one worker the native engine's decode weights are the policy's base itself."""
    gb = 2**30
    policy = cfg.actor_rollout_ref
    fsdp = actor_fsdp or policy.actor.fsdp_config
    native = policy.rollout.name != "hf" and native_rollout
    estimate = _policy_estimate(cfg, model_cfg, params, compute_bytes, logits_chunk_tokens)
    estimate["actor_states"] = _sharded_bytes(params, True, fsdp, cfg.world_size) / gb
    # the native engine's decode weights, in the compute dtype: its only copy
    if native:
        estimate["rollout_weights"] = compute_bytes * params / gb
    if cfg.world_size > 1 and fsdp.fsdp_size != 1 and not native:
        # sharded: the hf engine generates with a whole copy
        estimate["rollout_copy"] = 4 * params / gb
    lora = lora_trainable or {}
    # the frozen base once (the engine's, when not sharded), the adapters with AdamW
    if "actor" in lora:
        shards = _shards(fsdp, cfg.world_size)
        base = 0 if native and shards == 1 else compute_bytes * params / shards
        estimate["actor_states"] = (base + 16 * lora["actor"] / shards) / gb
    elif cfg.ref_enabled:
        estimate["reference"] = (
            _sharded_bytes(params, False, policy.ref.fsdp_config, cfg.world_size) / gb
        )
    critic_lora = lora.get("critic")
    # colocated with the actor
    if cfg.critic_enabled and "critic" not in cfg.pools:
        estimate["critic_states"] = (
            _critic_bytes(cfg, params, critic_lora, compute_bytes, cfg.world_size) / gb
        )
    estimate |= _teacher_gb(cfg, teacher)
    return _with_pools(cfg, model_cfg, params, compute_bytes, estimate, native, critic_lora)


def _teacher_gb(cfg: KeelConfig, teacher: tuple[int, int] | None) -> dict[str, float]:
    """The teacher's weights in GB on one of its devices, as `teacher` beside the policy or as
    `teacher_pool`: its `(parameters, bytes each)`, sharded over the ranks it runs on as the
    reference is (RoleBuilder.teacher), none on the device where FSDP offloads them."""
    if teacher is None or not cfg.teacher_enabled:
        return {}
    pooled = "teacher" in cfg.pools
    fsdp_cfg = cfg.actor_rollout_ref.ref.fsdp_config
    shards = _shards(fsdp_cfg, cfg.pools["teacher"] if pooled else cfg.world_size)
    parameters, bytes_each = teacher
    on_device = 0 if fsdp_cfg.param_offload and shards > 1 else parameters * bytes_each / shards
    return {("teacher_pool" if pooled else "teacher"): on_device / 2**30}


def _policy_estimate(
    cfg: KeelConfig, model_cfg, params: int, compute_bytes: int, logits_chunk_tokens: int
) -> dict[str, float]:
    """The actor's states' place (filled in by the caller), one micro-batch's activations and the
    KV cache of one generation batch, in GB."""
    gb, policy = 2**30, cfg.actor_rollout_ref
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    micro = policy.actor.ppo_micro_batch_size_per_gpu
    # The float32 logits and their gradient of one LOGITS_CHUNK_TOKENS chunk at a time (kept logits
    # size themselves to the memory a run leaves: forward.logits_chunking).
    logits = (
        min(micro * cfg.data.max_response_length, logits_chunk_tokens)
        * model_cfg.vocab_size
        * 4
        * 2
    )
    return {
        "actor_states": 0.0,
        "activations": (_activation_bytes(model_cfg, micro * seq, compute_bytes) + logits) / gb,
        "kv_cache": _kv_cache_bytes(model_cfg, seq * policy.rollout.max_num_seqs, compute_bytes)
        / gb,
    }


def _with_pools(
    cfg: KeelConfig,
    model_cfg,
    params: int,
    compute_bytes: int,
    estimate: dict[str, float],
    native: bool,
    critic_lora: int | None,
) -> dict[str, float]:
    """The total (a teacher's own pool outside it), then what the rollout's and the critic's own
    pools hold outside it, rounded."""
    gb = 2**30
    apart = (
        {}
        if cfg.actor_rollout_ref.hybrid_engine
        else {"rollout_pool": _rollout_apart(estimate, native, params / gb)}
    )
    estimate["total"] = sum(v for k, v in estimate.items() if k != "teacher_pool")
    estimate.update(apart)
    # the critic pool's devices: states and activations
    if cfg.critic_enabled and "critic" in cfg.pools:
        seq = cfg.data.max_prompt_length + cfg.data.max_response_length
        states = _critic_bytes(cfg, params, critic_lora, compute_bytes, cfg.critic_world_size)
        activations = _activation_bytes(model_cfg, cfg.critic_batching[1] * seq, compute_bytes)
        estimate["critic_pool"] = (states + activations) / gb
    # tiny models stay visible
    return {k: float(f"{v:.4g}") for k, v in estimate.items()}


def _rollout_apart(estimate: dict[str, float], native: bool, params_gb: float) -> float:
    """hybrid_engine=false: the engine's parts leave the actor's devices (`estimate`) -> what the
    rollout's own devices hold (hf generates with a whole float32 model of its own)."""
    kv_cache, weights = estimate.pop("kv_cache"), estimate.pop("rollout_weights", 0.0)
    # the actor's ranks' copy for hf: the rollout's own model instead
    estimate.pop("rollout_copy", None)
    return kv_cache + (weights if native else 4 * params_gb)


def _activation_bytes(model_cfg, tokens: int, compute_bytes: int) -> float:
    """Activations kept for the backward pass over `tokens` tokens (a micro-batch's samples x their
    length): about 34 bytes x hidden per token per layer in 16 bits (Korthikanti et al.)."""
    return 34 * model_cfg.hidden_size * model_cfg.num_hidden_layers * tokens * compute_bytes / 2


def _critic_bytes(
    cfg: KeelConfig, params: int, lora_params: int | None, compute_bytes: int, world: int
) -> float:
    """The critic's states on one of `world` ranks; with LoRA (`lora_params` trainable), the frozen
    base in the compute dtype and AdamW for the adapters alone."""
    fsdp_cfg = cfg.critic.model.fsdp_config
    if lora_params is None:
        return _sharded_bytes(params, True, fsdp_cfg, world)
    return (compute_bytes * params + 16 * lora_params) / _shards(fsdp_cfg, world)


def _kv_cache_bytes(model_cfg, tokens: int, compute_bytes: int) -> int:
    """Keys and values of every layer for `tokens` tokens (a generation batch: max_num_seqs whole
    sequences)."""
    heads = model_cfg.num_attention_heads
    kv_heads = getattr(model_cfg, "num_key_value_heads", heads) or heads
    head_dim = getattr(model_cfg, "head_dim", None) or model_cfg.hidden_size // heads
    return 2 * model_cfg.num_hidden_layers * kv_heads * head_dim * tokens * compute_bytes


def _sharded_bytes(params: int, trained: bool, fsdp_cfg, world: int) -> float:
    """Device bytes of one rank: float32 weights (and gradients, if trained) and AdamW's two
    moments, sharded over the fsdp group, minus what is offloaded to CPU."""
    shards = _shards(fsdp_cfg, world)
    # FSDP's: a single rank keeps its weights
    offloaded = fsdp_cfg.param_offload and shards > 1
    weights = 0 if offloaded else (8 if trained else 4) * params
    moments = 0 if (not trained or offloaded or fsdp_cfg.optimizer_offload) else 8 * params
    return (weights + moments) / shards


def _shards(fsdp_cfg, world: int) -> int:
    """How many ranks FSDP divides a role's weights among (1: whole on every rank)."""
    return world if fsdp_cfg.fsdp_size == -1 else fsdp_cfg.fsdp_size
