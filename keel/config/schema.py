"""keel's configuration: a typed tree of dataclasses with verl's key names.

Every field may carry constraints (`choices`, `ge`, `gt`, `le`) that `keel.config.load` checks when
it builds the tree; cross-field rules (batch divisibility, options that need each other) live in
keel.config.rules, run by `load_config`, each raising a coded error with the numbers and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from keel.algorithms.losses import LOSS_AGG_MODES, POLICY_LOSSES
from keel.config.agent import AgentConfig
from keel.config.algorithm import ADV_ESTIMATORS, GROUP_ESTIMATORS, KL_TYPES, AlgorithmConfig  # noqa: F401
from keel.config.distill import DistillationConfig
from keel.config.fields import LogProbBatching, ResourcePool, opt
from keel.config.multi_turn import MultiTurnConfig
from keel.config.resume import RESUME_MAY_CHANGE
from keel.config.reward import CustomRewardConfig, RewardConfig, RewardModelConfig
from keel.config.trainer import TrainerConfig

# float16 would need loss scaling
DTYPES = ("float32", "bfloat16", "auto")


@dataclass
class DataConfig:
    train_files: list[str] = opt(factory=list, help="parquet/jsonl prompt files (verl schema)")
    val_files: list[str] = opt(factory=list, help="held-out prompt files for validation")
    prompt_key: str = opt("prompt", help="column holding the prompt (chat messages or a string)")
    max_prompt_length: int = opt(512, gt=0)
    max_response_length: int = opt(512, gt=0)
    train_batch_size: int = opt(8, gt=0, help="prompts per RL step")
    val_batch_size: int | None = opt(None, gt=0, help="prompts per validation batch (default: all)")
    truncation: str = opt("error", choices=("error", "left", "right"))
    filter_overlong_prompts: bool = opt(False)
    apply_chat_template: bool = opt(True)
    shuffle: bool = opt(True)
    seed: int = opt(1, ge=0, help="seed of the prompt sampler")


@dataclass
class ModelOptions:
    """What every trained model's section holds besides where the model is (RL's and SFT's)."""

    dtype: str = opt(
        "auto",
        choices=DTYPES,
        help="compute dtype; auto: bfloat16 on GPU, float32 on CPU. Weights and optimiser state "
        "stay float32",
    )
    trust_remote_code: bool = opt(False)
    enable_gradient_checkpointing: bool = opt(False)


@dataclass
class LoraOptions:
    """LoRA (peft) on a trained model; lora_rank 0 trains every parameter."""

    lora_rank: int = opt(0, ge=0, help="LoRA rank; 0: full-parameter training")
    lora_alpha: int = opt(
        16, gt=0, help="LoRA scale numerator (the update is scaled by alpha / rank)"
    )
    target_modules: list[str] = opt(
        factory=lambda: ["all-linear"],
        help="all-linear (every projection of every decoder layer), or every projection's name",
    )
    exclude_modules: list[str] = opt(
        factory=list, help="linear layers (name patterns) to leave without adapters"
    )
    modules_to_save: list[str] = opt(
        factory=list,
        help="modules trained in full beside the adapters (e.g. embed_tokens); nothing else may "
        "train",
    )
    lora_adapter_path: str | None = opt(None, help="start from a saved PEFT adapter directory")


@dataclass
class ModelConfig(ModelOptions, LoraOptions):
    path: str = opt("", help="local Hugging Face model directory")


@dataclass
class OptimConfig:
    lr: float = opt(1e-6, gt=0)
    betas: list[float] = opt(factory=lambda: [0.9, 0.999])
    weight_decay: float = opt(0.01, ge=0)
    lr_warmup_steps: int = opt(-1, help="-1: use lr_warmup_steps_ratio")
    lr_warmup_steps_ratio: float = opt(0.0, ge=0, le=1)
    warmup_style: str = opt(
        "constant", choices=("constant", "cosine"), help="schedule after warm-up"
    )
    min_lr_ratio: float = opt(0.0, ge=0, le=1, help="cosine floor as a fraction of lr")


@dataclass
class PolicyLossConfig:
    loss_mode: str = opt("vanilla", choices=tuple(POLICY_LOSSES))


@dataclass
class FSDPConfig:
    param_offload: bool = opt(
        False, help="sharded parameters (and their gradients) live in CPU memory"
    )
    optimizer_offload: bool = opt(
        False,
        help="Adam's moments live in CPU memory; the step brings them to the GPU a 1 GiB bucket at "
        "a time",
    )
    reshard_after_forward: bool = opt(
        True,
        help="free gathered layers after forward: less memory, one more all-gather in backward",
    )
    fsdp_size: int = opt(
        -1,
        help="shard within groups of this many ranks, replicate across them; -1: all; "
        "1: no sharding, gradients all-reduced (DDP; for models that fit one GPU); "
        "the actor's, left unset on several GPUs: keel picks 1 when a whole replica "
        "takes at most half a GPU, else -1, logs why and keel check shows it",
    )


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = opt(4, gt=0, help="prompts per mini-batch (x rollout.n samples)")
    ppo_micro_batch_size_per_gpu: int = opt(4, gt=0, help="samples per forward/backward")
    use_dynamic_bsz: bool = opt(False, help="micro-batches by token budget instead of sample count")
    ppo_max_token_len_per_gpu: int = opt(
        16384, gt=0, help="use_dynamic_bsz: padded tokens per forward/backward"
    )
    ppo_epochs: int = opt(1, gt=0)
    shuffle: bool = opt(True, help="shuffle samples between mini-batches")
    clip_ratio: float = opt(0.2, gt=0)
    clip_ratio_low: float | None = opt(None, gt=0, help="default: clip_ratio")
    clip_ratio_high: float | None = opt(None, gt=0, help="default: clip_ratio (DAPO clip-higher)")
    clip_ratio_c: float = opt(3.0, gt=1, help="dual-clip bound for negative advantages")
    loss_agg_mode: str = opt("token-mean", choices=LOSS_AGG_MODES)
    policy_loss: PolicyLossConfig = opt(factory=PolicyLossConfig)
    entropy_coeff: float = opt(0.0, ge=0)
    use_kl_loss: bool = opt(False)
    kl_loss_coef: float = opt(0.001, ge=0)
    kl_loss_type: str = opt("low_var_kl", choices=KL_TYPES)
    grad_clip: float = opt(1.0, gt=0)
    use_torch_compile: bool = opt(
        True,
        help="GPU: torch.compile each decoder layer and the log-prob/entropy "
        "arithmetic over the vocabulary (actor, reference, critic)",
    )
    optim: OptimConfig = opt(factory=OptimConfig)
    fsdp_config: FSDPConfig = opt(factory=FSDPConfig)


@dataclass
class ValKwargs:
    n: int = opt(1, gt=0)
    do_sample: bool = opt(False)
    temperature: float = opt(0.0, ge=0)
    top_p: float = opt(1.0, gt=0, le=1)
    top_k: int = opt(-1, ge=-1)


@dataclass
class RolloutConfig(LogProbBatching):
    name: str = opt(
        "auto",
        choices=("auto", "native", "hf"),
        help="generation engine; auto: native where it supports the model, else hf",
    )
    n: int = opt(1, gt=0, help="samples per prompt")
    temperature: float = opt(1.0, gt=0)
    top_p: float = opt(1.0, gt=0, le=1)
    top_k: int = opt(-1, ge=-1, help="-1: off")
    do_sample: bool = opt(True)
    ignore_eos: bool = opt(
        False, help="generate max_response_length tokens whatever is sampled (benchmarks)"
    )
    max_num_seqs: int = opt(256, gt=0, help="sequences generated at once")
    max_num_batched_tokens: int = opt(8192, gt=0, help="native: prompt tokens per prefill pass")
    enable_chunked_prefill: bool = opt(
        True,
        help="native: a prompt longer than max_num_batched_tokens is prefilled in pieces; false "
        "refuses such a config",
    )
    max_model_len: int | None = opt(
        None,
        gt=0,
        help="longest prompt + response the rollout holds; default: data.max_prompt_length + "
        "data.max_response_length",
    )
    enforce_eager: bool = opt(
        False, help="native: no CUDA graphs and no torch.compile in decoding (debugging)"
    )
    batch_invariant: bool = opt(
        False,
        help="native: the sampler's log-probs and the old-log-prob pass equal bit for bit "
        "(log_prob_gap 0), each token's sums in an order of its own; slower decoding "
        "(with algorithm.rollout_correction.bypass_mode=true the pass is skipped: the same bits)",
    )
    free_cache_engine: bool | None = opt(
        None,
        help="native: true frees the KV cache after each generation; false "
        "keeps it, and its CUDA graphs, for the next batch of the same "
        "shape; null (keel's default): keeps it while it takes at most "
        "8% of the GPU's memory, or, once a step has trained, while it fits beside that "
        "step's memory within 90% of the GPU",
    )
    gpu_memory_utilization: float = opt(
        0.5,
        gt=0,
        le=1,
        help="native: share of the free GPU memory the KV cache may take (fewer sequences at once "
        "if needed)",
    )
    val_kwargs: ValKwargs = opt(factory=ValKwargs)
    multi_turn: MultiTurnConfig = opt(factory=MultiTurnConfig)
    agent: AgentConfig = opt(factory=AgentConfig)
    n_gpus_per_node: int = opt(1, gt=0, help="hybrid_engine=false: the rollout's workers per node")
    nnodes: int = opt(
        1, ge=0, help="hybrid_engine=false: the rollout's nodes (0, verl's default: 1)"
    )


@dataclass
class RefConfig(LogProbBatching):
    fsdp_config: FSDPConfig = opt(factory=FSDPConfig)


@dataclass
class ActorRolloutRefConfig:
    """verl's actor_rollout_ref: the policy's model, its training, its generation, and the
    reference."""

    model: ModelConfig = opt(factory=ModelConfig)
    actor: ActorConfig = opt(factory=ActorConfig)
    rollout: RolloutConfig = opt(
        factory=RolloutConfig, help="generation: the rollout engine and sampling"
    )
    ref: RefConfig = opt(
        factory=RefConfig, help="the frozen starting policy, loaded when a KL term needs it"
    )
    hybrid_engine: bool = opt(
        True,
        help="true: the rollout engine shares the actor's workers (and GPUs); false: it runs on "
        "workers of its own (rollout.n_gpus_per_node x rollout.nnodes, placed by Ray), which "
        "take the actor's weights after each update, tagged with the policy version (a LoRA "
        "policy's adapters only); with trainer.mode=async they generate while the actor "
        "trains",
    )


@dataclass
class CriticModelConfig(LoraOptions):
    path: str | None = opt(
        None, help="default: the actor's model path; computes in the actor's dtype"
    )
    fsdp_config: FSDPConfig = opt(factory=FSDPConfig)


@dataclass
class CriticOptimConfig(OptimConfig):
    lr: float = opt(1e-5, gt=0)


@dataclass
class CriticConfig(ResourcePool):
    enable: bool | None = opt(None, help="default: on when the advantage estimator needs values")
    model: CriticModelConfig = opt(factory=CriticModelConfig)
    optim: CriticOptimConfig = opt(factory=CriticOptimConfig)
    ppo_mini_batch_size: int | None = opt(None, gt=0, help="default: the actor's")
    ppo_micro_batch_size_per_gpu: int | None = opt(None, gt=0, help="default: the actor's")
    use_dynamic_bsz: bool = opt(False, help="micro-batches by token budget (values and updates)")
    ppo_max_token_len_per_gpu: int = opt(
        32768, gt=0, help="use_dynamic_bsz: padded tokens per forward"
    )
    ppo_epochs: int | None = opt(None, gt=0, help="default: the actor's")
    cliprange_value: float = opt(0.5, gt=0)
    loss_agg_mode: str = opt("token-mean", choices=LOSS_AGG_MODES)
    grad_clip: float = opt(1.0, gt=0)


@dataclass
class KeelConfig:
    data: DataConfig = opt(factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = opt(factory=ActorRolloutRefConfig)
    critic: CriticConfig = opt(factory=CriticConfig)
    algorithm: AlgorithmConfig = opt(factory=AlgorithmConfig)
    custom_reward_function: CustomRewardConfig = opt(factory=CustomRewardConfig)
    reward: RewardConfig = opt(factory=RewardConfig)
    reward_model: RewardModelConfig = opt(factory=RewardModelConfig)
    trainer: TrainerConfig = opt(factory=TrainerConfig)
    distillation: DistillationConfig = opt(
        factory=DistillationConfig,
        help="on-policy distillation: a frozen teacher scores the student's samples",
    )

    # Keys a resumed run may change (keel.config.resume says which and why).
    RESUME_MAY_CHANGE = RESUME_MAY_CHANGE

    # --- derived settings, so components never re-derive defaults on their own ---
    @property
    def world_size(self) -> int:
        return self.trainer.n_gpus_per_node * self.trainer.nnodes

    @property
    def pools(self) -> dict[str, int]:
        """Devices of each role that has a resource pool of its own (besides the policy's
        workers)."""
        pools = {}
        if self.critic_enabled and self.critic.enable_resource_pool:
            pools["critic"] = self.critic.n_gpus_per_node * self.critic.nnodes
        if self.reward_model.enable_resource_pool:
            pools["reward model"] = self.reward_model.n_gpus_per_node * self.reward_model.nnodes
        if self.teacher_enabled and self.distillation.teacher.enable_resource_pool:
            teacher = self.distillation.teacher
            pools["teacher"] = teacher.n_gpus_per_node * teacher.nnodes
        if not self.actor_rollout_ref.hybrid_engine:
            rollout = self.actor_rollout_ref.rollout
            pools["rollout"] = rollout.n_gpus_per_node * max(rollout.nnodes, 1)
        return pools

    @property
    def fsdp_roles(self) -> list[tuple[str, object, int]]:
        """(config key, fsdp_config, ranks) of every model this run trains or runs a forward of."""
        roles = [
            ("actor_rollout_ref.actor", self.actor_rollout_ref.actor.fsdp_config, self.world_size)
        ]
        if self.ref_enabled:
            roles.append(
                ("actor_rollout_ref.ref", self.actor_rollout_ref.ref.fsdp_config, self.world_size)
            )
        if self.critic_enabled:
            roles.append(("critic.model", self.critic.model.fsdp_config, self.critic_world_size))
        return roles

    @property
    def critic_world_size(self) -> int:
        """Ranks the critic trains on: its own pool's, or the actor's when colocated."""
        return self.pools.get("critic", self.world_size)

    @property
    def critic_enabled(self) -> bool:
        if self.critic.enable is not None:
            return self.critic.enable
        # distillation alone estimates no task advantage (rewards_teach), so no critic for it
        return self.algorithm.adv_estimator == "gae" and self.rewards_teach

    @property
    def critic_batching(self) -> tuple[int, int, int]:
        """(mini-batch prompts, micro-batch samples, epochs) of the critic: the actor's unless
        set."""
        c, actor = self.critic, self.actor_rollout_ref.actor
        return (
            c.ppo_mini_batch_size or actor.ppo_mini_batch_size,
            c.ppo_micro_batch_size_per_gpu or actor.ppo_micro_batch_size_per_gpu,
            c.ppo_epochs or actor.ppo_epochs,
        )

    @property
    def ref_enabled(self) -> bool:
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def teacher_enabled(self) -> bool:
        return self.distillation.enable

    @property
    def rewards_teach(self) -> bool:
        """Whether the reward function's scores reach the update (distillation with
        task_reward_coef=0 scores and logs them, and learns from the teacher alone)."""
        return not self.teacher_enabled or self.distillation.task_reward_coef > 0

    @property
    def run_dir(self) -> str:
        t = self.trainer
        return t.default_local_dir or f"checkpoints/{t.project_name}/{t.experiment_name}"
