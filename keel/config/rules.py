"""The RL config's cross-field rules: batch divisibility, token budgets, rollout lengths, the
workers' world, and options that need or exclude each other (distillation's in distill_rules).
Each raises a coded error with the numbers and the fix."""

from __future__ import annotations

from keel.config.async_rules import check_async
from keel.config.distill_rules import check_distillation
from keel.config.gkd_rules import check_gkd_lmbda
from keel.config.invariant_rules import check_batch_invariant
from keel.config.option_rules import (
    ROLLOUT,
    check_algorithm,
    check_reward,
    check_rollout_correction,
)
from keel.config.schema import KeelConfig
from keel.errors import BAD_VALUE, BATCH_ARITHMETIC, INCOMPATIBLE_OPTIONS, TOKEN_BUDGET, KeelError
from keel.errors.fixes import overrides, setting

RC = "algorithm.rollout_correction"


def check_config(cfg: KeelConfig) -> None:
    _check_batch_arithmetic(cfg)
    _check_options(cfg)
    check_batch_invariant(cfg)
    check_distillation(cfg)


def _check_batch_arithmetic(cfg: KeelConfig) -> None:
    actor = cfg.actor_rollout_ref.actor
    n = cfg.actor_rollout_ref.rollout.n
    prompts = cfg.data.train_batch_size
    critic_mini, critic_micro, _ = cfg.critic_batching
    roles = [
        (
            "actor",
            actor.ppo_mini_batch_size,
            actor.ppo_micro_batch_size_per_gpu,
            actor.use_dynamic_bsz,
        )
    ]
    if cfg.critic_enabled:
        roles.append(("critic", critic_mini, critic_micro, cfg.critic.use_dynamic_bsz))
    for role, mini, micro, dynamic in roles:
        key = "actor_rollout_ref.actor" if role == "actor" else "critic"
        if mini > prompts or prompts % mini:
            raise KeelError(
                BATCH_ARITHMETIC,
                f"data.train_batch_size={prompts} prompts do not split into {role} mini-batches of "
                f"{key}.ppo_mini_batch_size={mini} prompts",
                "set "
                f"{setting(f'{key}.ppo_mini_batch_size', largest_divisor_at_most(prompts, mini))} "
                f"(the nearest divisor of {prompts}), or "
                f"`data.train_batch_size={-(-prompts // mini) * mini}`",
            )
        # a token budget ignores the micro-batch size
        if (mini * n) % micro and not dynamic:
            divisor = largest_divisor_at_most(mini * n, micro)
            raise KeelError(
                BATCH_ARITHMETIC,
                f"the {role} mini-batch of {mini} prompts x rollout.n={n} = {mini * n} samples "
                f"does not split into micro-batches of {key}.ppo_micro_batch_size_per_gpu={micro}",
                "set "
                f"{setting(f'{key}.ppo_micro_batch_size_per_gpu', divisor)} "
                f"(the largest divisor of {mini * n} up to {micro})",
            )


def _check_token_budgets(cfg: KeelConfig) -> None:
    """A dynamic micro-batch must hold at least one sample of the longest possible length."""
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    policy = cfg.actor_rollout_ref
    budgets = [
        (
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
            policy.actor.use_dynamic_bsz,
            policy.actor.ppo_max_token_len_per_gpu,
        ),
        (
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
            policy.rollout.log_prob_use_dynamic_bsz,
            policy.rollout.log_prob_max_token_len_per_gpu,
        ),
        (
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
            policy.ref.log_prob_use_dynamic_bsz,
            policy.ref.log_prob_max_token_len_per_gpu,
        ),
        (
            "critic.ppo_max_token_len_per_gpu",
            cfg.critic.use_dynamic_bsz,
            cfg.critic.ppo_max_token_len_per_gpu,
        ),
    ]
    for key, enabled, budget in budgets:
        if enabled and budget < longest:
            raise KeelError(
                BATCH_ARITHMETIC,
                f"{key}={budget} is smaller than one sample can be: "
                f"data.max_prompt_length + data.max_response_length = {longest} tokens",
                f"set {setting(key, 2 * longest)} (at least {longest}; more lets samples "
                "share a pass)",
            )


def _check_rollout_lengths(cfg: KeelConfig, incompatible) -> None:
    """verl's rollout length keys, as vLLM reads them: a sequence must fit max_model_len, and
    without chunked prefill a whole prompt must fit one prefill pass."""
    rollout, longest = (
        cfg.actor_rollout_ref.rollout,
        cfg.data.max_prompt_length + cfg.data.max_response_length,
    )
    if rollout.max_model_len is not None and rollout.max_model_len < longest:
        raise KeelError(
            TOKEN_BUDGET,
            f"actor_rollout_ref.rollout.max_model_len={rollout.max_model_len} is shorter "
            f"than data.max_prompt_length + data.max_response_length = {longest}: long samples "
            "would not fit",
            f"set {setting(ROLLOUT + '.max_model_len', longest)}, or "
            + lengths_within(cfg, rollout.max_model_len, "rollout.max_model_len").removeprefix(
                "set "
            ),
        )
    if (
        not rollout.enable_chunked_prefill
        and rollout.max_num_batched_tokens < cfg.data.max_prompt_length
    ):
        raise incompatible(
            f"actor_rollout_ref.rollout.max_num_batched_tokens={rollout.max_num_batched_tokens} is "
            f"below data.max_prompt_length={cfg.data.max_prompt_length} and "
            "enable_chunked_prefill=false: a long prompt fits no prefill pass",
            f"set {setting(ROLLOUT + '.enable_chunked_prefill', True)}, or "
            f"{setting(ROLLOUT + '.max_num_batched_tokens', cfg.data.max_prompt_length)}",
        )


def _check_world(cfg: KeelConfig, incompatible) -> None:
    """Every rank needs at least one sample of every mini-batch, and FSDP groups must tile the
    world."""
    world = cfg.world_size
    n = cfg.actor_rollout_ref.rollout.n
    mini = cfg.actor_rollout_ref.actor.ppo_mini_batch_size * n
    if mini < world:
        raise KeelError(
            BATCH_ARITHMETIC,
            f"an actor mini-batch of {mini} samples cannot be split across "
            f"{world} workers (trainer.n_gpus_per_node x trainer.nnodes)",
            f"set {setting('actor_rollout_ref.actor.ppo_mini_batch_size', _mini_for(cfg, world))} "
            "(the smallest mini-batch of prompts that reaches every worker and divides "
            "data.train_batch_size)",
        )
    if cfg.critic.enable_resource_pool and not cfg.critic_enabled:
        raise incompatible(
            "critic.enable_resource_pool=true without a critic (critic.enable, or "
            "algorithm.adv_estimator=gae): there is nothing to place",
            f"set {setting('critic.enable_resource_pool', False)}",
        )
    policy = cfg.actor_rollout_ref
    if not policy.hybrid_engine and policy.model.lora_rank > 0 and policy.rollout.name == "hf":
        raise incompatible(
            "actor_rollout_ref.hybrid_engine=false with LoRA (model.lora_rank > 0) and "
            "rollout.name=hf: the rollout's own workers take only the adapters after each update, "
            "which keel's native engine applies and transformers' generate cannot",
            f"set {setting('actor_rollout_ref.rollout.name', 'native')} (or auto), or "
            f"{setting('actor_rollout_ref.hybrid_engine', True)}",
        )
    critic_mini = cfg.critic_batching[0] * n
    if cfg.critic_enabled and critic_mini < cfg.critic_world_size:
        raise KeelError(
            BATCH_ARITHMETIC,
            f"a critic mini-batch of {critic_mini} samples cannot be split across "
            f"{cfg.critic_world_size} critic workers",
            f"set {setting('critic.ppo_mini_batch_size', _mini_for(cfg, cfg.critic_world_size))}, "
            "or use fewer critic workers",
        )
    for key, fsdp, ranks in cfg.fsdp_roles:
        if fsdp.fsdp_size != -1 and (fsdp.fsdp_size < 1 or ranks % fsdp.fsdp_size):
            raise incompatible(
                f"{key}.fsdp_config.fsdp_size={fsdp.fsdp_size} does not divide the {ranks} workers",
                f"set {setting(key + '.fsdp_config.fsdp_size', -1)} (shard over all {ranks}), "
                f"or a divisor of {ranks}",
            )
        if fsdp.fsdp_size == 1 and fsdp.param_offload and ranks > 1:
            raise incompatible(
                f"{key}.fsdp_config.fsdp_size=1 (no sharding) with param_offload=true: offloading "
                "parameters is FSDP's, and fsdp_size=1 does not use FSDP",
                f"set {setting(key + '.fsdp_config.fsdp_size', -1)} to shard and offload, or "
                f"{setting(key + '.fsdp_config.param_offload', False)}",
            )


def largest_divisor_at_most(total: int, limit: int) -> int:
    return max(d for d in range(1, min(total, limit) + 1) if total % d == 0)


def lengths_within(cfg: KeelConfig, limit: int, read_by: str) -> str:
    """The fix for prompt plus response over `limit` tokens: the response shortened to fit, else
    both."""
    prompt, response = cfg.data.max_prompt_length, cfg.data.max_response_length
    fit = (
        {"data.max_response_length": limit - prompt}
        if limit - prompt >= min(response, 16)
        else {"data.max_prompt_length": limit - limit // 4, "data.max_response_length": limit // 4}
    )
    return f"set {overrides(fit)} (together {limit} tokens, what {read_by} reads)"


def _mini_for(cfg: KeelConfig, workers: int) -> int:
    """The smallest mini-batch of prompts that gives each of `workers` a sample and divides the
    batch."""
    prompts, least = cfg.data.train_batch_size, -(-workers // cfg.actor_rollout_ref.rollout.n)
    return next((m for m in range(least, prompts + 1) if prompts % m == 0), least)


def check_betas(key: str, betas: list[float]) -> None:
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise KeelError(
            BAD_VALUE,
            f"{key}.betas={betas} must be two numbers in [0, 1)",
            f"set {setting(key + '.betas', [0.9, 0.999])} (AdamW's usual betas)",
        )


def incompatible(message: str, fix: str) -> KeelError:
    return KeelError(INCOMPATIBLE_OPTIONS, message, fix)


def _sampling(val) -> dict:
    """val_kwargs that sample: do_sample on, and a temperature above 0."""
    return {
        ROLLOUT + ".val_kwargs.do_sample": True,
        ROLLOUT + ".val_kwargs.temperature": val.temperature or 1.0,
    }


def _check_options(cfg: KeelConfig) -> None:
    rollout = cfg.actor_rollout_ref.rollout
    check_algorithm(cfg, incompatible)
    check_rollout_correction(cfg, incompatible)
    check_reward(cfg, incompatible)
    check_async(cfg, incompatible)
    check_gkd_lmbda(cfg)
    val = rollout.val_kwargs
    if val.n > 1 and not (val.do_sample and val.temperature > 0):
        raise incompatible(
            f"rollout.val_kwargs.n={val.n} with greedy decoding gives {val.n} identical answers",
            f"set {overrides(_sampling(val))}, or {setting(ROLLOUT + '.val_kwargs.n', 1)}",
        )
    if val.do_sample and val.temperature == 0:
        raise incompatible(
            "rollout.val_kwargs.do_sample=true with temperature=0 is greedy decoding",
            f"set {overrides(_sampling(val))}, or "
            f"{setting(ROLLOUT + '.val_kwargs.do_sample', False)}",
        )
    for key, optim in (
        ("actor_rollout_ref.actor.optim", cfg.actor_rollout_ref.actor.optim),
        ("critic.optim", cfg.critic.optim),
    ):
        check_betas(key, optim.betas)
    if not rollout.do_sample and rollout.n > 1:
        raise incompatible(
            f"actor_rollout_ref.rollout.do_sample=false with rollout.n={rollout.n}: greedy samples "
            "of one prompt are identical",
            f"set {setting(ROLLOUT + '.do_sample', True)}, or {setting(ROLLOUT + '.n', 1)}",
        )
    multi_turn = rollout.multi_turn
    if multi_turn.environment and multi_turn.interaction_config_path:
        raise incompatible(
            "rollout.multi_turn.environment and rollout.multi_turn.interaction_config_path both "
            "answer the turns without tool calls",
            f"keep one: {setting(ROLLOUT + '.multi_turn.interaction_config_path', None)} (keel's "
            f"environment), or {setting(ROLLOUT + '.multi_turn.environment', None)} (verl's "
            "interactions)",
        )
    _check_world(cfg, incompatible)
    _check_token_budgets(cfg)
    _check_rollout_lengths(cfg, incompatible)
    agent = cfg.actor_rollout_ref.rollout.agent
    if not cfg.data.train_files and not (agent.environment or "").startswith("verifiers:"):
        raise incompatible(
            "data.train_files is empty",
            "set data.train_files to parquet/jsonl files (a verifiers environment brings its "
            "own dataset)",
        )
    if agent.function and agent.environment:
        raise incompatible(
            "rollout.agent.function and rollout.agent.environment both name the rollout",
            f"keep one: {setting(ROLLOUT + '.agent.environment', None)} (your agent function), or "
            f"{setting(ROLLOUT + '.agent.function', None)} (the environment)",
        )
    if not cfg.actor_rollout_ref.model.path:
        raise incompatible(
            "actor_rollout_ref.model.path is empty",
            "set actor_rollout_ref.model.path to a local Hugging Face model directory",
        )
