"""keel's configuration: a typed tree of dataclasses with verl's key names.

Every field may carry constraints (`choices`, `ge`, `gt`, `le`) that `keel.config.load` checks when
it builds the tree; cross-field rules (batch divisibility, options that need each other) live in
`validate()` at the bottom, each raising a coded error with the numbers and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from keel.errors import BAD_VALUE, BATCH_ARITHMETIC, INCOMPATIBLE_OPTIONS, TOKEN_BUDGET, KeelError


def opt(default: Any = None, *, choices: tuple | None = None, ge: float | None = None,
        gt: float | None = None, le: float | None = None, help: str = "", factory=None):
    """A config field with its constraints and a one-line help."""
    meta = {"choices": choices, "ge": ge, "gt": gt, "le": le, "help": help}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


DTYPES = ("float32", "bfloat16", "auto")  # float16 would need loss scaling
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax")
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")


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
class ModelConfig:
    path: str = opt("", help="local Hugging Face model directory")
    dtype: str = opt("auto", choices=DTYPES,
                     help="compute dtype; auto: bfloat16 on GPU, float32 on CPU. Weights and optimiser state stay "
                          "float32")
    trust_remote_code: bool = opt(False)
    enable_gradient_checkpointing: bool = opt(False)


@dataclass
class OptimConfig:
    lr: float = opt(1e-6, gt=0)
    betas: list[float] = opt(factory=lambda: [0.9, 0.999])
    weight_decay: float = opt(0.01, ge=0)
    lr_warmup_steps: int = opt(-1, help="-1: use lr_warmup_steps_ratio")
    lr_warmup_steps_ratio: float = opt(0.0, ge=0, le=1)
    warmup_style: str = opt("constant", choices=("constant", "cosine"), help="schedule after warm-up")
    min_lr_ratio: float = opt(0.0, ge=0, le=1, help="cosine floor as a fraction of lr")


@dataclass
class PolicyLossConfig:
    loss_mode: str = opt("vanilla", choices=("vanilla", "gspo"))


@dataclass
class FSDPConfig:
    param_offload: bool = opt(False, help="sharded parameters (and their gradients) live in CPU memory")
    optimizer_offload: bool = opt(False, help="optimiser state lives in CPU memory between steps")
    reshard_after_forward: bool = opt(True, help="free gathered layers after forward: less memory, one "
                                                 "more all-gather in backward")
    fsdp_size: int = opt(-1, help="shard within groups of this many ranks, replicate across them; -1: all; "
                                   "1: no sharding, gradients all-reduced (DDP; for models that fit one GPU)")


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = opt(4, gt=0, help="prompts per mini-batch (x rollout.n samples)")
    ppo_micro_batch_size_per_gpu: int = opt(4, gt=0, help="samples per forward/backward")
    use_dynamic_bsz: bool = opt(False, help="micro-batches by token budget instead of sample count")
    ppo_max_token_len_per_gpu: int = opt(16384, gt=0, help="use_dynamic_bsz: padded tokens per forward/backward")
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
    use_torch_compile: bool = opt(True, help="GPU: torch.compile each decoder layer and the log-prob/entropy "
                                             "arithmetic over the vocabulary (actor, reference, critic)")
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
class RolloutConfig:
    name: str = opt("auto", choices=("auto", "native", "hf"),
                    help="generation engine; auto: native where it supports the model, else hf")
    n: int = opt(1, gt=0, help="samples per prompt")
    temperature: float = opt(1.0, gt=0)
    top_p: float = opt(1.0, gt=0, le=1)
    top_k: int = opt(-1, ge=-1, help="-1: off")
    do_sample: bool = opt(True)
    ignore_eos: bool = opt(False, help="generate max_response_length tokens whatever is sampled (benchmarks)")
    max_num_seqs: int = opt(256, gt=0, help="sequences generated at once")
    max_num_batched_tokens: int = opt(8192, gt=0, help="native: prompt tokens per prefill pass")
    enable_chunked_prefill: bool = opt(True, help="native: a prompt longer than max_num_batched_tokens is prefilled "
                                                  "in pieces; false refuses such a config")
    max_model_len: int | None = opt(None, gt=0, help="longest prompt + response the rollout holds; default: "
                                                     "data.max_prompt_length + data.max_response_length")
    enforce_eager: bool = opt(False, help="native: no CUDA graphs and no torch.compile in decoding (debugging)")
    free_cache_engine: bool = opt(True, help="native: free the KV cache after each generation; false keeps it, "
                                             "and its CUDA graph, for the next batch of the same shape")
    gpu_memory_utilization: float = opt(0.5, gt=0, le=1, help="native: share of the free GPU memory the KV "
                                                              "cache may take (fewer sequences at once if needed)")
    log_prob_micro_batch_size_per_gpu: int = opt(8, gt=0)
    log_prob_use_dynamic_bsz: bool = opt(False, help="old log-prob micro-batches by token budget")
    log_prob_max_token_len_per_gpu: int = opt(32768, gt=0, help="log_prob_use_dynamic_bsz: padded tokens per forward")
    val_kwargs: ValKwargs = opt(factory=ValKwargs)


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = opt(8, gt=0)
    log_prob_use_dynamic_bsz: bool = opt(False, help="reference log-prob micro-batches by token budget")
    log_prob_max_token_len_per_gpu: int = opt(32768, gt=0, help="log_prob_use_dynamic_bsz: padded tokens per forward")
    fsdp_config: FSDPConfig = opt(factory=FSDPConfig)


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = opt(factory=ModelConfig)
    actor: ActorConfig = opt(factory=ActorConfig)
    rollout: RolloutConfig = opt(factory=RolloutConfig)
    ref: RefConfig = opt(factory=RefConfig)


@dataclass
class CriticModelConfig:
    path: str | None = opt(None, help="default: the actor's model path; computes in the actor's dtype")
    fsdp_config: FSDPConfig = opt(factory=FSDPConfig)


@dataclass
class CriticOptimConfig(OptimConfig):
    lr: float = opt(1e-5, gt=0)


@dataclass
class CriticConfig:
    enable: bool | None = opt(None, help="default: on when the advantage estimator needs values")
    model: CriticModelConfig = opt(factory=CriticModelConfig)
    optim: CriticOptimConfig = opt(factory=CriticOptimConfig)
    ppo_mini_batch_size: int | None = opt(None, gt=0, help="default: the actor's")
    ppo_micro_batch_size_per_gpu: int | None = opt(None, gt=0, help="default: the actor's")
    use_dynamic_bsz: bool = opt(False, help="micro-batches by token budget (values and updates)")
    ppo_max_token_len_per_gpu: int = opt(32768, gt=0, help="use_dynamic_bsz: padded tokens per forward")
    ppo_epochs: int | None = opt(None, gt=0, help="default: the actor's")
    cliprange_value: float = opt(0.5, gt=0)
    loss_agg_mode: str = opt("token-mean", choices=LOSS_AGG_MODES)
    grad_clip: float = opt(1.0, gt=0)
    enable_resource_pool: bool = opt(False, help="train it on GPUs of its own (its own Ray workers) instead of "
                                                 "colocated with the actor")
    n_gpus_per_node: int = opt(1, gt=0, help="enable_resource_pool: critic workers per node")
    nnodes: int = opt(1, gt=0, help="enable_resource_pool: nodes")


@dataclass
class KLControlConfig:
    type: str = opt("fixed", choices=("fixed", "adaptive"))
    kl_coef: float = opt(0.001, ge=0)
    target_kl: float = opt(0.1, gt=0)
    horizon: int = opt(10000, gt=0)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = opt("gae", choices=ADV_ESTIMATORS)
    gamma: float = opt(1.0, ge=0, le=1)
    lam: float = opt(1.0, ge=0, le=1)
    norm_adv_by_std_in_grpo: bool = opt(True, help="false gives Dr. GRPO")
    use_kl_in_reward: bool = opt(False)
    kl_penalty: str = opt("kl", choices=KL_TYPES, help="KL estimator in the reward")
    kl_ctrl: KLControlConfig = opt(factory=KLControlConfig)
    critic_warmup: int = opt(0, ge=0, help="steps that train only the critic (verl trains the actor one "
                                            "step earlier than its name says; keel does not)")


@dataclass
class OverlongBufferConfig:
    enable: bool = opt(False, help="DAPO's soft overlong punishment (arXiv 2503.14476)")
    len: int = opt(64, gt=0, help="the last `len` tokens before max_response_length are penalised")
    penalty_factor: float = opt(1.0, ge=0, help="penalty at max_response_length")


@dataclass
class RewardNormConfig:
    enable: bool = opt(False, help="running mean/std normalisation of scores")
    window_size: int = opt(1000, gt=1, help="scores the mean and std are taken over")
    eps: float = opt(1e-6, gt=0)
    clip: float | None = opt(5.0, gt=0, help="clip z-scores to [-clip, clip]; null: no clip")


@dataclass
class RewardServiceConfig:
    url: str | None = opt(None, help="a keel reward-server, e.g. http://127.0.0.1:8000; scores every sample")
    timeout_s: float = opt(30.0, gt=0, help="per request")
    retry_times: int = opt(3, ge=0)
    retry_delay_s: float = opt(1.0, ge=0, help="doubles after each retry")
    token: str | None = opt(None, help="bearer token, if the server wants one")


@dataclass
class SandboxConfig:
    require: str = opt("isolation", choices=("isolation", "all", "none"),
                       help="what model-written code (code_exec) needs of the jail: its isolation (own filesystem "
                            "view, no network, own pid namespace, an unprivileged user), every protection keel doctor "
                            "lists, or none (run with what there is, warned)")


@dataclass
class RewardConfig:
    scorers: dict[str, dict[str, float]] = opt(
        factory=dict, help="data_source -> {scorer: weight}, e.g. {gsm8k: {gsm8k: 0.9, think_answer_format: 0.1}}; "
                           "sources not listed use the built-in dispatch")
    overlong_buffer: OverlongBufferConfig = opt(factory=OverlongBufferConfig)
    normalize: RewardNormConfig = opt(factory=RewardNormConfig)
    service: RewardServiceConfig = opt(factory=RewardServiceConfig)
    sandbox: SandboxConfig = opt(factory=SandboxConfig)
    on_error: str = opt("mask", choices=("mask", "zero", "raise"),
                        help="a sample the scorer fails on: left out of the update, scored 0, or stop")
    max_not_scored_ratio: float = opt(0.1, ge=0, le=1, help="stop when a batch has more not-scored samples")
    timeout_s: float | None = opt(30.0, gt=0, help="per-sample scoring time limit")
    num_workers: int = opt(0, ge=0, help="scoring processes; 0 scores in the trainer's process")


@dataclass
class RewardModelPathConfig:
    path: str | None = opt(None, help="local sequence-classification model (num_labels=1)")
    trust_remote_code: bool = opt(False)


@dataclass
class RewardModelConfig:
    enable: bool = opt(False, help="score with a reward model (all data_sources, unless reward.scorers maps them)")
    model: RewardModelPathConfig = opt(factory=RewardModelPathConfig)
    micro_batch_size_per_gpu: int = opt(16, gt=0)
    max_length: int | None = opt(None, gt=0, help="tokens it reads; default: its max_position_embeddings")
    enable_resource_pool: bool = opt(False, help="run it on devices of its own (Ray actors, one replica per GPU) "
                                                 "instead of in the driver, beside the policy's first rank")
    n_gpus_per_node: int = opt(1, gt=0, help="enable_resource_pool: replicas per node")
    nnodes: int = opt(1, gt=0, help="enable_resource_pool: nodes")


@dataclass
class CustomRewardConfig:
    path: str | None = opt(None, help="python file defining the reward function")
    name: str = opt("compute_score")
    batched: bool = opt(False, help="the function takes lists (data_sources, solution_strs, ground_truths, "
                                    "extra_infos) and returns a list of scores")


@dataclass
class GuardsConfig:
    nonfinite: str = opt("stop", choices=("stop", "skip"), help="NaN/inf in a stage: stop, or skip the step")
    zero_signal_steps: int = opt(5, gt=0, help="warn after this many steps with no reward variance")
    max_clip_ratio: float = opt(0.9, ge=0, le=1, help="warn when more responses hit max_response_length")
    min_response_length: float = opt(1.5, ge=0, help="warn when responses average fewer tokens")
    min_entropy: float = opt(0.01, ge=0, help="warn below this entropy (collapse)")
    max_kl: float = opt(1.0, gt=0, help="warn above this ppo_kl or ref_kl (blow-up)")
    phase_timeout_s: float | None = opt(3600.0, gt=0, help="a phase running longer dumps stacks and exits "
                                        "(null: never; a hang outside a collective would wait forever)")


@dataclass
class TrainerConfig:
    project_name: str = opt("keel")
    experiment_name: str = opt("run")
    default_local_dir: str | None = opt(None, help="default: checkpoints/<project>/<experiment>")
    total_epochs: int = opt(1, gt=0)
    total_training_steps: int | None = opt(None, gt=0, help="default: epochs x batches per epoch")
    test_freq: int = opt(-1, help="validate every N steps; -1: never")
    val_before_train: bool = opt(True)
    save_freq: int = opt(-1, help="checkpoint every N steps; -1: only at the end")
    max_actor_ckpt_to_keep: int | None = opt(None, gt=0, help="older checkpoints are deleted")
    resume_mode: str = opt("auto", help="auto | disable | path of a global_step_<N> dir")
    seed: int = opt(1, ge=0)
    device: str = opt("auto", choices=("auto", "cpu", "cuda"))
    logger: list[str] = opt(factory=lambda: ["console"], choices=("console",),
                            help="console; metrics.jsonl is always written")
    log_samples: int = opt(4, ge=0, help="samples per step written to samples.jsonl")
    n_gpus_per_node: int = opt(1, gt=0, help="workers per node (CPU processes with device=cpu)")
    nnodes: int = opt(1, gt=0, help="nodes of the Ray cluster (RAY_ADDRESS) to train on")
    collective_timeout_s: float = opt(300.0, gt=0, help="a collective waiting longer fails (NCCL's "
                                                        "default is 600 s)")
    guards: GuardsConfig = opt(factory=GuardsConfig)
    hooks: list[str] = opt(factory=list, help="`module:function` called as fn(step, metrics, batch)")
    hook_freq: int = opt(1, gt=0, help="call hooks every N steps")


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

    # Keys a resumed run may change: when it stops; how often it logs, validates and saves; how it
    # cuts micro-batches; how many workers it has and how they shard; which engine generates.
    # Anything else would make the resumed run a different run.
    RESUME_MAY_CHANGE = (
        # when it stops, what it logs and where
        "trainer.total_training_steps", "trainer.total_epochs", "trainer.resume_mode", "trainer.logger",
        "trainer.log_samples", "trainer.default_local_dir", "trainer.project_name", "trainer.experiment_name",
        "trainer.guards.", "trainer.hooks", "trainer.hook_freq",
        # validation and checkpoints
        "trainer.test_freq", "trainer.val_before_train", "data.val_files", "data.val_batch_size",
        "actor_rollout_ref.rollout.val_kwargs.", "trainer.save_freq", "trainer.max_actor_ckpt_to_keep",
        # devices, workers, sharding
        "trainer.device", "trainer.n_gpus_per_node", "trainer.nnodes", "trainer.collective_timeout_s",
        "actor_rollout_ref.actor.fsdp_config.", "actor_rollout_ref.ref.fsdp_config.", "critic.model.fsdp_config.",
        "critic.enable_resource_pool", "critic.n_gpus_per_node", "critic.nnodes",  # its checkpoint is the same
        "reward_model.enable_resource_pool", "reward_model.n_gpus_per_node", "reward_model.nnodes",
        # generation engine
        "actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.max_num_seqs",
        "actor_rollout_ref.rollout.max_num_batched_tokens", "actor_rollout_ref.rollout.gpu_memory_utilization",
        "actor_rollout_ref.rollout.enforce_eager", "actor_rollout_ref.rollout.free_cache_engine",
        "actor_rollout_ref.rollout.enable_chunked_prefill", "actor_rollout_ref.rollout.max_model_len",
        # kernels and compute precision (weights and optimiser state are float32 whatever they are)
        "actor_rollout_ref.actor.use_torch_compile", "actor_rollout_ref.model.dtype",
        # micro-batches (the numbers do not depend on them)
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.actor.use_dynamic_bsz",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        "critic.ppo_micro_batch_size_per_gpu", "critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu",
    )

    # --- derived settings, so components never re-derive defaults on their own ---
    @property
    def world_size(self) -> int:
        return self.trainer.n_gpus_per_node * self.trainer.nnodes

    @property
    def pools(self) -> dict[str, int]:
        """Devices of each role that has a resource pool of its own (besides the policy's workers)."""
        pools = {}
        if self.critic_enabled and self.critic.enable_resource_pool:
            pools["critic"] = self.critic.n_gpus_per_node * self.critic.nnodes
        if self.reward_model.enable_resource_pool:
            pools["reward model"] = self.reward_model.n_gpus_per_node * self.reward_model.nnodes
        return pools

    @property
    def fsdp_roles(self) -> list[tuple[str, object, int]]:
        """(config key, fsdp_config, ranks) of every model this run trains or runs a forward of."""
        roles = [("actor_rollout_ref.actor", self.actor_rollout_ref.actor.fsdp_config, self.world_size)]
        if self.ref_enabled:
            roles.append(("actor_rollout_ref.ref", self.actor_rollout_ref.ref.fsdp_config, self.world_size))
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
        return self.algorithm.adv_estimator == "gae"

    @property
    def critic_batching(self) -> tuple[int, int, int]:
        """(mini-batch prompts, micro-batch samples, epochs) of the critic: the actor's unless set."""
        c, actor = self.critic, self.actor_rollout_ref.actor
        return (c.ppo_mini_batch_size or actor.ppo_mini_batch_size,
                c.ppo_micro_batch_size_per_gpu or actor.ppo_micro_batch_size_per_gpu,
                c.ppo_epochs or actor.ppo_epochs)

    @property
    def ref_enabled(self) -> bool:
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def run_dir(self) -> str:
        t = self.trainer
        return t.default_local_dir or f"checkpoints/{t.project_name}/{t.experiment_name}"

    def validate(self) -> None:
        """Cross-field rules; single fields are checked by the loader."""
        _check_batch_arithmetic(self)
        _check_options(self)


def _check_batch_arithmetic(cfg: KeelConfig) -> None:
    actor = cfg.actor_rollout_ref.actor
    n = cfg.actor_rollout_ref.rollout.n
    prompts = cfg.data.train_batch_size
    critic_mini, critic_micro, _ = cfg.critic_batching
    roles = [("actor", actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu, actor.use_dynamic_bsz)]
    if cfg.critic_enabled:
        roles.append(("critic", critic_mini, critic_micro, cfg.critic.use_dynamic_bsz))
    for role, mini, micro, dynamic in roles:
        key = "actor_rollout_ref.actor" if role == "actor" else "critic"
        if mini > prompts or prompts % mini:
            raise KeelError(
                BATCH_ARITHMETIC,
                f"data.train_batch_size={prompts} prompts do not split into {role} mini-batches of "
                f"{key}.ppo_mini_batch_size={mini} prompts",
                f"set {key}.ppo_mini_batch_size to a divisor of {prompts} (e.g. "
                f"{_largest_divisor_at_most(prompts, mini)})")
        if (mini * n) % micro and not dynamic:  # a token budget ignores the micro-batch size
            raise KeelError(
                BATCH_ARITHMETIC,
                f"the {role} mini-batch of {mini} prompts x rollout.n={n} = {mini * n} samples does not "
                f"split into micro-batches of {key}.ppo_micro_batch_size_per_gpu={micro}",
                f"set {key}.ppo_micro_batch_size_per_gpu to a divisor of {mini * n} (e.g. "
                f"{_largest_divisor_at_most(mini * n, micro)})")


def _check_token_budgets(cfg: KeelConfig) -> None:
    """A dynamic micro-batch must hold at least one sample of the longest possible length."""
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    policy = cfg.actor_rollout_ref
    budgets = [("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", policy.actor.use_dynamic_bsz,
                policy.actor.ppo_max_token_len_per_gpu),
               ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", policy.rollout.log_prob_use_dynamic_bsz,
                policy.rollout.log_prob_max_token_len_per_gpu),
               ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", policy.ref.log_prob_use_dynamic_bsz,
                policy.ref.log_prob_max_token_len_per_gpu),
               ("critic.ppo_max_token_len_per_gpu", cfg.critic.use_dynamic_bsz, cfg.critic.ppo_max_token_len_per_gpu)]
    for key, enabled, budget in budgets:
        if enabled and budget < longest:
            raise KeelError(BATCH_ARITHMETIC, f"{key}={budget} is smaller than one sample can be: "
                            f"data.max_prompt_length + data.max_response_length = {longest} tokens",
                            f"set {key} to at least {longest} (a few times more lets samples share a pass)")


def _check_rollout_lengths(cfg: KeelConfig, incompatible) -> None:
    """verl's rollout length keys, as vLLM reads them: a sequence must fit max_model_len, and
    without chunked prefill a whole prompt must fit one prefill pass."""
    rollout, longest = cfg.actor_rollout_ref.rollout, cfg.data.max_prompt_length + cfg.data.max_response_length
    if rollout.max_model_len is not None and rollout.max_model_len < longest:
        raise KeelError(TOKEN_BUDGET, f"actor_rollout_ref.rollout.max_model_len={rollout.max_model_len} is shorter "
                        f"than data.max_prompt_length + data.max_response_length = {longest}: long samples "
                        "would not fit", f"set rollout.max_model_len to at least {longest}, or lower the lengths")
    if not rollout.enable_chunked_prefill and rollout.max_num_batched_tokens < cfg.data.max_prompt_length:
        raise incompatible(f"actor_rollout_ref.rollout.max_num_batched_tokens={rollout.max_num_batched_tokens} is "
                           f"below data.max_prompt_length={cfg.data.max_prompt_length} and "
                           "enable_chunked_prefill=false: a long prompt fits no prefill pass",
                           "set rollout.enable_chunked_prefill=true, or max_num_batched_tokens to at least "
                           f"{cfg.data.max_prompt_length}")


def _check_world(cfg: KeelConfig, incompatible) -> None:
    """Every rank needs at least one sample of every mini-batch, and FSDP groups must tile the world."""
    world = cfg.world_size
    n = cfg.actor_rollout_ref.rollout.n
    mini = cfg.actor_rollout_ref.actor.ppo_mini_batch_size * n
    if mini < world:
        raise KeelError(BATCH_ARITHMETIC, f"an actor mini-batch of {mini} samples cannot be split across "
                        f"{world} workers (trainer.n_gpus_per_node x trainer.nnodes)",
                        f"raise actor_rollout_ref.actor.ppo_mini_batch_size to at least {-(-world // n)} prompts")
    if cfg.critic.enable_resource_pool and not cfg.critic_enabled:
        raise incompatible("critic.enable_resource_pool=true without a critic (critic.enable, or "
                           "algorithm.adv_estimator=gae): there is nothing to place",
                           "set critic.enable_resource_pool=false")
    critic_mini = cfg.critic_batching[0] * n
    if cfg.critic_enabled and critic_mini < cfg.critic_world_size:
        raise KeelError(BATCH_ARITHMETIC, f"a critic mini-batch of {critic_mini} samples cannot be split across "
                        f"{cfg.critic_world_size} critic workers", "raise critic.ppo_mini_batch_size, or use "
                        "fewer critic workers")
    for key, fsdp, ranks in cfg.fsdp_roles:
        if fsdp.fsdp_size != -1 and (fsdp.fsdp_size < 1 or ranks % fsdp.fsdp_size):
            raise incompatible(f"{key}.fsdp_config.fsdp_size={fsdp.fsdp_size} does not divide the {ranks} workers",
                               f"set {key}.fsdp_config.fsdp_size to -1 or a divisor of {ranks}")
        if fsdp.fsdp_size == 1 and fsdp.param_offload and ranks > 1:
            raise incompatible(f"{key}.fsdp_config.fsdp_size=1 (no sharding) with param_offload=true: offloading "
                               "parameters is FSDP's, and fsdp_size=1 does not use FSDP",
                               f"set {key}.fsdp_config.fsdp_size=-1 to shard and offload, or param_offload=false")


def _largest_divisor_at_most(total: int, limit: int) -> int:
    return max(d for d in range(1, min(total, limit) + 1) if total % d == 0)


def check_betas(key: str, betas: list[float]) -> None:
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise KeelError(BAD_VALUE, f"{key}.betas={betas} must be two numbers in [0, 1)",
                        f"set {key}.betas, e.g. [0.9, 0.999]")


def _check_options(cfg: KeelConfig) -> None:
    est = cfg.algorithm.adv_estimator
    rollout = cfg.actor_rollout_ref.rollout

    def incompatible(message: str, fix: str) -> KeelError:
        return KeelError(INCOMPATIBLE_OPTIONS, message, fix)

    if est in GROUP_ESTIMATORS and rollout.n < 2:
        raise incompatible(
            f"algorithm.adv_estimator={est} compares samples of the same prompt, but "
            f"actor_rollout_ref.rollout.n=1: every advantage would be 0 and nothing would learn",
            "set actor_rollout_ref.rollout.n to 2 or more (GRPO typically uses 4-16)")
    if est == "gae" and not cfg.critic_enabled:
        raise incompatible("algorithm.adv_estimator=gae needs a critic but critic.enable=false",
                           "set critic.enable=true, or choose grpo/rloo/reinforce_plus_plus")
    if cfg.custom_reward_function.batched and (cfg.reward.scorers or not cfg.custom_reward_function.path):
        raise incompatible("custom_reward_function.batched=true needs custom_reward_function.path and no "
                           "reward.scorers mapping: a batched function scores every sample itself",
                           "set custom_reward_function.path, or remove reward.scorers")
    if cfg.reward_model.enable and not cfg.reward_model.model.path:
        raise incompatible("reward_model.enable=true without reward_model.model.path",
                           "set reward_model.model.path to a local sequence-classification model")
    if cfg.reward_model.enable_resource_pool and not cfg.reward_model.enable:
        raise incompatible("reward_model.enable_resource_pool=true with reward_model.enable=false: there is no "
                           "reward model to place", "set reward_model.enable=true, or enable_resource_pool=false")
    overlong = cfg.reward.overlong_buffer
    if overlong.enable and overlong.len >= cfg.data.max_response_length:
        raise incompatible(f"reward.overlong_buffer.len={overlong.len} is not shorter than "
                           f"data.max_response_length={cfg.data.max_response_length}: every response would be "
                           "penalised", "set reward.overlong_buffer.len to a fraction of max_response_length")
    if est == "remax" and not rollout.do_sample:
        raise incompatible("algorithm.adv_estimator=remax compares samples with a greedy baseline, but "
                           "rollout.do_sample=false makes every sample the baseline: all advantages 0",
                           "set actor_rollout_ref.rollout.do_sample=true")
    if cfg.algorithm.critic_warmup > 0 and not cfg.critic_enabled:
        raise incompatible(f"algorithm.critic_warmup={cfg.algorithm.critic_warmup} with no critic: the "
                           "policy would not be updated for those steps", "set algorithm.critic_warmup=0")
    val = rollout.val_kwargs
    if val.n > 1 and not (val.do_sample and val.temperature > 0):
        raise incompatible(f"rollout.val_kwargs.n={val.n} with greedy decoding gives {val.n} identical answers",
                           "set val_kwargs.do_sample=true and val_kwargs.temperature > 0, or val_kwargs.n=1")
    if val.do_sample and val.temperature == 0:
        raise incompatible("rollout.val_kwargs.do_sample=true with temperature=0 is greedy decoding",
                           "set val_kwargs.temperature > 0 to sample, or val_kwargs.do_sample=false")
    for key, optim in (("actor_rollout_ref.actor.optim", cfg.actor_rollout_ref.actor.optim),
                       ("critic.optim", cfg.critic.optim)):
        check_betas(key, optim.betas)
    if not rollout.do_sample and rollout.n > 1:
        raise incompatible(
            f"actor_rollout_ref.rollout.do_sample=false with rollout.n={rollout.n}: greedy samples "
            "of one prompt are identical", "set rollout.do_sample=true or rollout.n=1")
    _check_world(cfg, incompatible)
    _check_token_budgets(cfg)
    _check_rollout_lengths(cfg, incompatible)
    if not cfg.data.train_files:
        raise incompatible("data.train_files is empty", "set data.train_files to parquet/jsonl files")
    if not cfg.actor_rollout_ref.model.path:
        raise incompatible("actor_rollout_ref.model.path is empty",
                           "set actor_rollout_ref.model.path to a local Hugging Face model directory")
