"""The RL config's keys a resumed run may change: anything else would make it a different run."""

from __future__ import annotations

# Keys a resumed run may change: when it stops; how often it logs, validates and saves; how it
# cuts micro-batches; how many workers it has and how they shard; which engine generates.
# Anything else would make the resumed run a different run.
RESUME_MAY_CHANGE = (
    # when it stops, what it logs and where
    "trainer.total_training_steps",
    "trainer.total_epochs",
    "trainer.resume_mode",
    "trainer.logger",
    "trainer.log_samples",
    "trainer.default_local_dir",
    "trainer.project_name",
    "trainer.experiment_name",
    "trainer.guards.",
    "trainer.hooks",
    "trainer.hook_freq",
    # validation and checkpoints
    "trainer.test_freq",
    "trainer.val_before_train",
    "data.val_files",
    "data.val_batch_size",
    "actor_rollout_ref.rollout.val_kwargs.",
    "trainer.save_freq",
    "trainer.max_actor_ckpt_to_keep",
    # devices, workers, sharding
    "trainer.device",
    "trainer.n_gpus_per_node",
    "trainer.nnodes",
    "trainer.collective_timeout_s",
    "actor_rollout_ref.actor.fsdp_config.",
    "actor_rollout_ref.ref.fsdp_config.",
    "critic.model.fsdp_config.",
    "critic.enable_resource_pool",
    "critic.n_gpus_per_node",
    # its checkpoint is the same
    "critic.nnodes",
    "reward_model.enable_resource_pool",
    "reward_model.n_gpus_per_node",
    "reward_model.nnodes",
    # the distillation teacher is frozen and holds no checkpoint: its pool and its micro-batches
    # (a teacher pass out of memory resumes with smaller ones) change no number
    "distillation.teacher.enable_resource_pool",
    "distillation.teacher.n_gpus_per_node",
    "distillation.teacher.nnodes",
    "distillation.teacher.log_prob_",
    # where the rollout runs, not what it samples
    "actor_rollout_ref.hybrid_engine",
    "actor_rollout_ref.rollout.n_gpus_per_node",
    "actor_rollout_ref.rollout.nnodes",
    # generation engine
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.max_num_seqs",
    "actor_rollout_ref.rollout.max_num_batched_tokens",
    "actor_rollout_ref.rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.enforce_eager",
    "actor_rollout_ref.rollout.free_cache_engine",
    "actor_rollout_ref.rollout.enable_chunked_prefill",
    "actor_rollout_ref.rollout.max_model_len",
    # kernels and compute precision (weights and optimiser state are float32 whatever they are)
    "actor_rollout_ref.actor.use_torch_compile",
    "actor_rollout_ref.model.dtype",
    "actor_rollout_ref.rollout.batch_invariant",
    # micro-batches (the numbers do not depend on them)
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
    "critic.ppo_micro_batch_size_per_gpu",
    "critic.use_dynamic_bsz",
    "critic.ppo_max_token_len_per_gpu",
)
