"""The rules for verl's configuration keys (keel.config.verl applies them), each one of three things in keel: honoured (keel's schema has the key,
same meaning), accepted (keel already does what it asks, or it does not apply: what keel does
instead is said once, and `keel check` lists it), or refused by name (KEEL-C015: what it does in
verl, what to use in keel). No verl key gets the generic unknown-key error.

The rules are glob patterns over dotted keys, first match wins. A refusal may depend on the value:
`ulysses_sequence_parallel_size: 1` is accepted (no sequence parallelism), `2` is refused.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Callable

ACCEPT, RENAME, REFUSE = "accept", "rename", "refuse"


@dataclass(frozen=True)
class Rule:
    pattern: str
    kind: str                                   # ACCEPT | RENAME | REFUSE
    note: str                                   # what keel does instead / what verl does, and what to use
    allowed: Callable[[Any], bool] | None = None  # REFUSE only for values this does not allow
    target: str | None = None                   # RENAME: keel's key


def quiet(key: str, value) -> bool:
    """A value that asks for nothing (off, unset, one, a class path): accepted without a note."""
    return _off(value) or key.endswith("._target_")


def _off(value) -> bool:
    return value in (None, False, 0, 1, "", {}, [], "disabled", "naive", "fsdp", "fsdp2", "register") or (
        isinstance(value, str) and value.startswith("${"))


def _one(value) -> bool:
    return value in (None, 1) or (isinstance(value, str) and value.startswith("${"))


def _null(value) -> bool:
    return value is None or (isinstance(value, str) and value.startswith("${"))


NO_VLLM = "keel generates with its own engine (keel has no vLLM or SGLang), whatever the engine setting"
RULES = [
    # --- what keel does anyway, or what does not apply --------------------------------------------
    Rule("*.use_remove_padding", ACCEPT, "keel never computes over padding: micro-batches are trimmed to their "
         "longest sequence and batched by tokens with use_dynamic_bsz"),
    Rule("*.use_shm", ACCEPT, "keel loads models from local disk directly; no shared-memory copy is made"),
    Rule("*.profiler.*", ACCEPT, "keel's profiler is `keel bench --profile`; verl's profiler settings are ignored"),
    Rule("global_profiler.*", ACCEPT, "keel's profiler is `keel bench --profile`; verl's profiler settings are ignored"),
    Rule("*._target_", ACCEPT, "verl's class paths for its config objects; keel's config is typed already"),
    Rule("*.strategy", REFUSE, "Megatron-LM training: keel trains with FSDP2 (or DDP); set strategy=fsdp",
         lambda v: _off(v) or v in ("fsdp", "fsdp2")),
    Rule("*.megatron.*", ACCEPT, "Megatron-LM settings; keel trains with FSDP2, so they do not apply"),
    Rule("*.checkpoint.*", ACCEPT, "keel's checkpoints always hold the model, optimiser and extra state; the "
         "actor's is a Hugging Face model"),
    Rule("*.ulysses_sequence_parallel_size", REFUSE, "Ulysses sequence parallelism splits one sequence over GPUs; "
         "keel does not: set it to 1, and use use_dynamic_bsz with a token budget for long sequences", _one),
    Rule("*.fsdp_config.wrap_policy.*", ACCEPT, "keel wraps every decoder layer, then the root (FSDP2)"),
    Rule("*.fsdp_config.offload_policy", ACCEPT, "keel's offload is param_offload / optimizer_offload"),
    Rule("*.fsdp_config.forward_prefetch", ACCEPT, "FSDP2 prefetches the next layer itself"),
    Rule("*.fsdp_config.model_dtype", ACCEPT, "keel keeps trained weights in float32 and computes in model.dtype"),
    Rule("*.fsdp_config.dtype", ACCEPT, "keel computes in actor_rollout_ref.model.dtype (bf16 on GPU by default)"),
    Rule("*.fsdp_config.use_orig_params", ACCEPT, "FSDP2 always keeps the original parameters"),
    Rule("*.fsdp_config.seed", ACCEPT, "keel seeds every rank from trainer.seed"),
    Rule("*.fsdp_config.full_determinism", ACCEPT, "keel's CPU runs are exact; GPU kernels keep their own order"),
    Rule("*.fsdp_config.forward_only", ACCEPT, "keel knows which models only run forward passes"),
    Rule("*.fsdp_config.use_torch_compile", ACCEPT, "keel's switch is actor_rollout_ref.actor.use_torch_compile"),
    Rule("*.fsdp_config.strategy", REFUSE, "Megatron-LM training: keel trains with FSDP2", lambda v: _off(v)),
    Rule("*.entropy_from_logits_with_chunking", ACCEPT, "keel computes log-probs and entropy over chunks of "
         "1024 positions always"),
    Rule("*.entropy_checkpointing", ACCEPT, "keel recomputes each logits chunk in backward always"),
    Rule("*.use_torch_compile", ACCEPT, "keel's switch is actor_rollout_ref.actor.use_torch_compile"),
    Rule("*.rollout_n", ACCEPT, "keel reads actor_rollout_ref.rollout.n"),
    Rule("*.data_loader_seed", ACCEPT, "keel's mini-batch order follows trainer.seed"),
    Rule("*.use_dynamic_bsz", ACCEPT, "this role's micro-batches follow the actor's (use_dynamic_bsz)"),
    Rule("*.forward_max_token_len_per_gpu", ACCEPT, "forward passes use the role's ppo_max_token_len_per_gpu"),
    Rule("*.forward_micro_batch_size*", ACCEPT, "forward passes use the role's micro-batch size"),
    Rule("*.router_replay.mode", REFUSE, "MoE router replay; keel does not replay routes", _off),
    Rule("*.router_replay.*", ACCEPT, "MoE router replay files; unused without router_replay.mode"),
    Rule("*.model.use_fused_kernels", ACCEPT, "keel fuses the vocabulary arithmetic with torch.compile "
         "(actor.use_torch_compile)"),
    Rule("*.use_fused_kernels", ACCEPT, "keel fuses the vocabulary arithmetic with torch.compile"),
    Rule("*.fused_kernel_options.*", ACCEPT, "keel fuses the vocabulary arithmetic with torch.compile"),
    Rule("*.model.use_liger", ACCEPT, "keel computes log-probs in chunks itself; Liger kernels are not used"),
    Rule("*.model.external_lib", REFUSE, "imports a module to register a custom model; keel loads Hugging Face "
         "models with trust_remote_code", _null),
    Rule("*.model.override_config", REFUSE, "overrides the model's config.json; edit the checkpoint's config "
         "instead", lambda v: v in (None, {}) or _null(v)),
    Rule("*.model.hf_config_path", REFUSE, "reads the config from another path; keel reads model.path", _null),
    Rule("*.model.tokenizer_path", REFUSE, "a tokenizer from another path; keel reads model.path", _null),
    Rule("*.model.input_tokenizer", ACCEPT, "keel's reward model reads its own tokenizer and chat template"),
    Rule("*.model.custom_chat_template", REFUSE, "a chat template other than the tokenizer's; put it in the "
         "tokenizer's chat_template", _null),
    Rule("*.model.enable_activation_offload", REFUSE, "activation offload; keel has gradient checkpointing "
         "(model.enable_gradient_checkpointing)", lambda v: not v or _null(v)),
    Rule("*.model.tiled_mlp.enabled", REFUSE, "tiled MLP for long sequences; not in keel", lambda v: not v),
    Rule("*.model.tiled_mlp.*", ACCEPT, "tiled MLP settings; unused without tiled_mlp.enabled"),
    Rule("*.model.mtp.enable*", REFUSE, "multi-token prediction; not in keel", lambda v: not v or _null(v)),
    Rule("*.model.mtp.*", ACCEPT, "multi-token prediction settings; unused without mtp.enable"),
    Rule("*.mtp", ACCEPT, "multi-token prediction; not in keel"),
    Rule("*.model.lora_rank", REFUSE, "LoRA; keel trains full parameters until LoRA lands (issue 15): set 0",
         lambda v: v in (0, None)),
    Rule("*.model.lora_alpha", ACCEPT, "LoRA settings; unused with lora_rank 0"),
    Rule("*.model.target_modules", ACCEPT, "LoRA settings; unused with lora_rank 0"),
    Rule("*.model.exclude_modules", ACCEPT, "LoRA settings; unused with lora_rank 0"),
    Rule("*.model.lora_adapter_path", REFUSE, "starts from a LoRA adapter; not in keel yet", _null),
    Rule("critic.model.enable_gradient_checkpointing", ACCEPT, "keel's critic follows "
         "actor_rollout_ref.model.enable_gradient_checkpointing"),
    Rule("critic.model.trust_remote_code", ACCEPT, "keel's critic follows actor_rollout_ref.model.trust_remote_code"),
    Rule("*.freeze_vision_tower", ACCEPT, "keel trains text models"),
    Rule("*.tau_pos", ACCEPT, "SAPO's temperatures; keel has no SAPO loss (actor.policy_loss.loss_mode)"),
    Rule("*.tau_neg", ACCEPT, "SAPO's temperatures; keel has no SAPO loss"),
    Rule("*.policy_loss.*", ACCEPT, "settings of policy losses keel does not have (clip_cov, kl_cov, ...); "
         "actor.policy_loss.loss_mode says which loss runs"),
    Rule("*.loss_scale_factor", REFUSE, "a constant loss scale; keel divides by the mini-batch's token count",
         _null),
    Rule("*.calculate_entropy", ACCEPT, "keel computes the entropy in every update (actor/entropy)"),
    Rule("*.calculate_sum_pi_squared", ACCEPT, "a diagnostic keel does not log"),
    Rule("*.sum_pi_squared_checkpointing", ACCEPT, "a diagnostic keel does not log"),
    Rule("*.use_prefix_grouper", ACCEPT, "keel prefills each distinct prompt once for its n samples"),
    Rule("*.optim.optimizer", REFUSE, "keel's optimiser is AdamW", lambda v: v in (None, "AdamW", "adamw")),
    Rule("*.optim.optimizer_impl", ACCEPT, "keel uses torch's AdamW (fused on GPU)"),
    Rule("*.optim.total_training_steps", ACCEPT, "keel's schedules last trainer.total_training_steps"),
    Rule("*.optim.num_cycles", ACCEPT, "keel's cosine schedule decays once, to min_lr_ratio"),
    Rule("*.optim.override_optimizer_config", REFUSE, "optimiser arguments beyond lr, betas and weight_decay",
         lambda v: v in (None, {})),
    Rule("actor_rollout_ref.actor.optim.clip_grad", RENAME, "verl's newer name", target="actor_rollout_ref.actor.grad_clip"),
    Rule("critic.optim.clip_grad", RENAME, "verl's newer name", target="critic.grad_clip"),
    Rule("*.optim.lr_scheduler_type", ACCEPT, "keel's schedule is optim.warmup_style (constant or cosine)"),
    Rule("actor_rollout_ref.hybrid_engine", ACCEPT, "keel's actor, rollout and reference always share GPUs"),
    Rule("actor_rollout_ref.nccl_timeout", ACCEPT, "keel's collective timeout is trainer.collective_timeout_s"),
    Rule("trainer.ray_wait_register_center_timeout", ACCEPT, "keel's workers start within their own timeout"),
    Rule("trainer.use_legacy_worker_impl", ACCEPT, "keel has one worker implementation"),
    Rule("trainer.balance_batch", ACCEPT, "keel always splits batches across ranks by tokens"),
    Rule("trainer.critic_warmup", RENAME, "verl's place for it", target="algorithm.critic_warmup"),
    Rule("trainer.max_critic_ckpt_to_keep", ACCEPT, "keel keeps the critic in the same checkpoints as the actor "
         "(trainer.max_actor_ckpt_to_keep)"),
    Rule("trainer.esi_redundant_time", ACCEPT, "a cloud-preemption setting; keel saves at save_freq"),
    Rule("trainer.default_hdfs_dir", REFUSE, "copies checkpoints to HDFS; keel writes to default_local_dir", _null),
    Rule("trainer.del_local_ckpt_after_load", REFUSE, "deletes a checkpoint after resuming from it", lambda v: not v),
    Rule("trainer.resume_from_path", RENAME, "keel takes the path in trainer.resume_mode", target=None),
    Rule("trainer.val_only", REFUSE, "validation without training; run `keel train` with "
         "trainer.total_training_steps=0 and val_before_train", lambda v: not v),
    Rule("trainer.rollout_data_dir", ACCEPT, "keel writes trainer.log_samples samples a step to samples.jsonl"),
    Rule("trainer.validation_data_dir", ACCEPT, "keel logs trainer.log_val_generations validation samples"),
    Rule("transfer_queue.*", REFUSE, "verl's transfer queue; keel's driver moves batches itself", _off),
    Rule("ray_kwargs.*", ACCEPT, "keel starts Ray itself, sized for the machine (or joins RAY_ADDRESS)"),
    # --- data --------------------------------------------------------------------------------------
    Rule("data.tokenizer", REFUSE, "a tokenizer other than the model's", _null),
    Rule("data.use_shm", ACCEPT, "keel reads data files directly"),
    Rule("data.train_max_samples", REFUSE, "caps the training rows; cut the file instead", lambda v: v in (None, -1)),
    Rule("data.val_max_samples", REFUSE, "caps the validation rows; cut the file instead", lambda v: v in (None, -1)),
    Rule("data.reward_fn_key", REFUSE, "the column naming the scorer; keel reads data_source",
         lambda v: v in (None, "data_source")),
    Rule("data.tool_config_path", ACCEPT, "tools are multi-turn rollout settings (rollout.multi_turn)"),
    Rule("data.return_raw_input_ids", ACCEPT, "keel keeps each prompt's tokens with its record"),
    Rule("data.return_raw_chat", ACCEPT, "keel keeps each row's raw prompt for reward models and scorers"),
    Rule("data.return_full_prompt", ACCEPT, "keel keeps the templated prompt text with each record"),
    Rule("data.return_multi_modal_inputs", ACCEPT, "keel trains text models"),
    Rule("data.dataloader_num_workers", ACCEPT, "keel loads and tokenises the whole dataset once, at start"),
    Rule("data.image_patch_size", ACCEPT, "keel trains text models"),
    Rule("data.image_key", ACCEPT, "keel trains text models"),
    Rule("data.video_key", ACCEPT, "keel trains text models"),
    Rule("data.validation_shuffle", ACCEPT, "keel validates on every held-out prompt in order"),
    Rule("data.filter_overlong_prompts_workers", ACCEPT, "keel filters prompts in one pass at start"),
    Rule("data.trust_remote_code", ACCEPT, "keel's tokenizer follows actor_rollout_ref.model.trust_remote_code"),
    Rule("data.custom_cls.*", REFUSE, "a custom dataset class; keel reads verl's parquet/jsonl schema", _null),
    Rule("data.sampler.*", REFUSE, "a custom sampler (curriculum); keel samples uniformly per epoch", _null),
    Rule("data.datagen.*", REFUSE, "generated data; keel reads files", _null),
    Rule("data.apply_chat_template_kwargs", REFUSE, "extra chat-template arguments (e.g. enable_thinking)",
         lambda v: v in (None, {})),
    # --- rollout -----------------------------------------------------------------------------------
    Rule("actor_rollout_ref.rollout.mode", ACCEPT, "keel's engine runs in the trainer's process (sync or async "
         "alike)"),
    Rule("actor_rollout_ref.rollout.prompt_length", ACCEPT, "keel reads data.max_prompt_length"),
    Rule("actor_rollout_ref.rollout.response_length", ACCEPT, "keel reads data.max_response_length"),
    Rule("actor_rollout_ref.rollout.dtype", ACCEPT, "keel generates in actor_rollout_ref.model.dtype"),
    Rule("actor_rollout_ref.rollout.cudagraph_capture_sizes", ACCEPT, "keel captures a graph per batch size it runs"),
    Rule("*.tensor_model_parallel_size", ACCEPT, "keel's engine holds the whole model on each GPU and needs no "
         "tensor parallelism for the models it runs; each GPU generates its share of the batch"),
    Rule("*.data_parallel_size", ACCEPT, "every keel worker generates its share of the batch"),
    Rule("*.expert_parallel_size", REFUSE, "expert parallelism for MoE models; not in keel", _one),
    Rule("*.pipeline_model_parallel_size", REFUSE, "pipeline parallelism; not in keel", _one),
    Rule("*.enable_prefix_caching", ACCEPT, "keel prefills each distinct prompt once for its n samples"),
    Rule("*.logprobs_mode", ACCEPT, "keel's sampler returns the log-probs of logits / temperature"),
    Rule("*.scheduling_policy", ACCEPT, "keel's engine generates a batch at a time"),
    Rule("*.load_format", ACCEPT, "keel's engine takes the trainer's weights directly"),
    Rule("actor_rollout_ref.rollout.log_prob_micro_batch_size", REFUSE, "the old global micro-batch size; use "
         "log_prob_micro_batch_size_per_gpu", _null),
    Rule("actor_rollout_ref.ref.log_prob_micro_batch_size", REFUSE, "the old global micro-batch size; use "
         "log_prob_micro_batch_size_per_gpu", _null),
    Rule("*.ppo_micro_batch_size", REFUSE, "the old global micro-batch size; use ppo_micro_batch_size_per_gpu",
         _null),
    Rule("*.micro_batch_size", REFUSE, "the old global micro-batch size; use micro_batch_size_per_gpu", _null),
    Rule("*.disable_log_stats", ACCEPT, "keel logs its engine's timing in timing_s/gen_*"),
    Rule("*.over_sample_rate", REFUSE, "over-sampling to drop slow rollouts; not in keel", lambda v: v in (0, None)),
    Rule("*.multi_stage_wake_up", ACCEPT, "keel's engine keeps one copy of the weights; nothing wakes up"),
    Rule("*.engine_kwargs", ACCEPT, NO_VLLM),
    Rule("*.engine_kwargs.*", ACCEPT, NO_VLLM),
    Rule("actor_rollout_ref.rollout.multi_turn.enable", REFUSE, "multi-turn tool rollouts; keel's rollouts are "
         "single-turn until multi-turn lands (issue 16)", lambda v: not v),
    Rule("actor_rollout_ref.rollout.multi_turn.*", ACCEPT, "multi-turn settings; unused with multi_turn.enable false"),
    Rule("actor_rollout_ref.rollout.calculate_log_probs", ACCEPT, "keel's engine returns the sampler's log-probs "
         "always (rollout/log_prob_gap)"),
    Rule("actor_rollout_ref.rollout.agent.*", ACCEPT, "agent-loop settings; keel's rollouts are single-turn"),
    Rule("actor_rollout_ref.rollout.checkpoint_engine.*", ACCEPT, "keel syncs weights into its engine in buckets"),
    Rule("actor_rollout_ref.rollout.trace.*", ACCEPT, "rollout tracing; keel writes samples.jsonl"),
    Rule("actor_rollout_ref.rollout.skip_rollout", REFUSE, "replays dumped rollouts; not in keel", lambda v: not v),
    Rule("actor_rollout_ref.rollout.skip_dump_dir", ACCEPT, "unused without skip_rollout"),
    Rule("*.skip_tokenizer_init", ACCEPT, "keel's engine never tokenises"),
    Rule("*.enable_rollout_routing_replay", REFUSE, "MoE routing replay; not in keel", lambda v: not v),
    Rule("actor_rollout_ref.rollout.prometheus.enable", REFUSE, "Prometheus metrics of the engine; keel logs to "
         "trainer.logger", lambda v: not v),
    Rule("actor_rollout_ref.rollout.prometheus.*", ACCEPT, "unused without prometheus.enable"),
    Rule("*.quantization", REFUSE, "quantised rollout (fp8); keel generates in model.dtype", _null),
    Rule("*.quantization_config_file", REFUSE, "quantised rollout (fp8); keel generates in model.dtype", _null),
    Rule("*.limit_images", ACCEPT, "keel trains text models"),
    Rule("actor_rollout_ref.rollout.layered_summon", ACCEPT, "keel gathers sharded weights into its engine a "
         "bucket at a time already"),
    # --- reward and algorithm ----------------------------------------------------------------------
    Rule("reward_manager.*", ACCEPT, "keel's reward manager is naive unless the config says batched or dapo"),
    Rule("reward_model.reward_loop_*", ACCEPT, "keel scores in the driver or in reward_model's pool"),
    Rule("reward_model.use_reward_loop", ACCEPT, "keel scores in the driver or in reward_model's pool"),
    Rule("reward_model.launch_reward_fn_async", ACCEPT, "keel scores in reward.num_workers processes"),
    Rule("reward_model.num_workers", ACCEPT, "keel's scoring processes are reward.num_workers"),
    Rule("reward_model.sandbox_fusion.url", REFUSE, "SandboxFusion, a remote code sandbox; keel runs code in its "
         "own jail (code_exec scorer) or calls reward.service.url", _null),
    Rule("reward_model.sandbox_fusion.*", ACCEPT, "unused without sandbox_fusion.url"),
    Rule("reward_model.rollout.*", ACCEPT, "a generative reward model's engine; keel's reward models classify"),
    Rule("reward_model.model.fsdp_config.*", ACCEPT, "keel's reward model runs whole, one replica per device"),
    Rule("reward_model.model.*", ACCEPT, "keel's reward model reads model.path with its own tokenizer"),
    Rule("algorithm.rollout_correction.rollout_is", REFUSE, "importance-sampling correction from the sampler's "
         "log-probs (TIS/MIS); keel recomputes old log-probs instead", _null),
    Rule("algorithm.rollout_correction.rollout_rs", REFUSE, "rejection sampling on the sampler/trainer ratio; "
         "keel recomputes old log-probs instead", _null),
    Rule("algorithm.rollout_correction.bypass_mode", REFUSE, "skips the old-log-prob pass; keel recomputes it",
         lambda v: not v),
    Rule("algorithm.rollout_correction.*", ACCEPT, "unused without rollout_is or rollout_rs"),
    Rule("algorithm.use_pf_ppo", REFUSE, "preference-feedback PPO reweighting; not in keel", lambda v: not v),
    Rule("algorithm.pf_ppo.*", ACCEPT, "unused without use_pf_ppo"),
    Rule("critic.shuffle", ACCEPT, "keel's critic follows actor_rollout_ref.actor.shuffle"),
    Rule("critic.model.tokenizer_path", ACCEPT, "keel's critic reads the policy's tokenizer"),
]

RULES.sort(key=lambda rule: rule.pattern.startswith("*"))  # a rule naming its section wins over a wildcard

# Values verl writes for a key keel has, meaning "not set": keel uses its own default (said once).
UNSET_VALUES = {
    "reward_model.nnodes": (0,), "reward_model.n_gpus_per_node": (0,),
    "actor_rollout_ref.rollout.name": ("???", "vllm", "sglang", "trtllm"),
}


# verl derives these from another key when they are not set (OmegaConf references in its yaml).
DERIVED = {
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "critic.use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "critic.loss_agg_mode": "actor_rollout_ref.actor.loss_agg_mode",
}


# Keys whose keel default is deliberately not verl's: (verl's default, why keel's). `keel check`
# shows each one a config leaves unset, so the same script never trains differently in silence.
DIFFERENT_DEFAULTS = {
    "actor_rollout_ref.actor.shuffle": (False, "samples are shuffled between mini-batches, so a mini-batch is "
                                        "not one prompt's group"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": (True, "off: faster for the models that fit; turn it "
                                                              "on for long sequences or large models"),
    "trainer.total_epochs": (30, "one pass over the data unless asked"),
    "data.train_batch_size": (1024, "small defaults that run on one GPU or a CPU"),
    "actor_rollout_ref.actor.ppo_mini_batch_size": (256, "small defaults that run on one GPU or a CPU"),
    "trainer.n_gpus_per_node": (8, "one worker unless asked"),
    "trainer.device": ("cuda", "auto: the GPU when there is one, else the CPU"),
    "trainer.logger": (["console", "wandb"], "console only: a tracker is asked for, never assumed"),
}


def rule_for(key: str) -> Rule | None:
    return next((rule for rule in RULES if fnmatch.fnmatchcase(key, rule.pattern)), None)
