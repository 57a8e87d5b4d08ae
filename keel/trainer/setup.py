"""Build what the RL loop needs from a config: data, models, engines, reward, run directory.

Everything that can fail on bad input is built here, before the run directory is touched, so a
mistake costs seconds and leaves nothing behind.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from keel.algorithms.advantages import ADV_ESTIMATORS
from keel.algorithms.kl import make_kl_controller
from keel.config.plan import Plan, plan_of
from keel.config.schema import KeelConfig
from keel.data.prompts import PromptRecord, build_prompt_dataset, load_rows
from keel.data.responses import response_texts, trains_on_responses
from keel.data.sampler import ResumableSampler
from keel.distributed.group import LocalGroup
from keel.distributed.pools import RewardModelPool, role_group, rollout_group
from keel.distributed.worker import RoleWorker, WorkerSpec
from keel.errors import DATA_EMPTY, KeelError
from keel.errors.fixes import setting, whole_batches
from keel.models.load import load_tokenizer, quiet_transformers, resolve_device
from keel.rewards.custom_fn import load_custom_reward_fn
from keel.rewards.model import RewardModel
from keel.rewards.normalize import RunningNormalizer
from keel.rewards.reward_fn import RewardScorer
from keel.rewards.service import RewardServiceClient
from keel.rewards.worker import file_spec, module_location
from keel.rollout.agent.external.library_env import environment_rows
from keel.trainer.roles import WorkerRoles
from keel.trainer.sharding import decide_sharding

log = logging.getLogger("keel")


@dataclass
class Components:
    # keel's decisions for the config, with the sharding the workers were built with
    plan: Plan
    tokenizer: object
    train_data: list[PromptRecord]
    val_data: list[PromptRecord]
    sampler: ResumableSampler
    workers: WorkerRoles
    reward: RewardScorer
    kl_ctrl: object
    normalizer: RunningNormalizer | None
    total_steps: int


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Inputs:
    """What `keel check` loaded and judged, handed to the trainer so it is not loaded again."""

    tokenizer: object
    train_records: list[PromptRecord]
    val_records: list[PromptRecord]
    reward: RewardScorer


def read_prompts(files: list[str], tokenizer, cfg: KeelConfig, name: str):
    """(records, stats): the prompts of `files` as the config says to cut or drop them."""
    d = cfg.data
    agent = cfg.actor_rollout_ref.rollout.agent
    rows = load_rows(files, f"data.{name}_files") if files else environment_rows(agent, name)
    records, stats = build_prompt_dataset(
        rows or [],
        tokenizer,
        prompt_key=d.prompt_key,
        max_prompt_length=d.max_prompt_length,
        truncation=d.truncation,
        filter_overlong_prompts=d.filter_overlong_prompts,
        apply_chat_template=d.apply_chat_template,
        name=name,
    )
    # gkd's off-policy steps train on each row's response: read with its prompt (a row without one
    # fails here, in keel check too), and carried by its record
    if name == "train" and trains_on_responses(cfg):
        texts = response_texts(rows or [], records, cfg)
        for record in records:
            record.response = texts[record.index]
    return records, stats


def load_prompts(files: list[str], tokenizer, cfg: KeelConfig, name: str) -> list[PromptRecord]:
    records, stats = read_prompts(files, tokenizer, cfg, name)
    log.info(stats.summary())
    return records


def require_enough_prompts(count: int, cfg: KeelConfig) -> None:
    if count < cfg.data.train_batch_size:
        raise KeelError(
            DATA_EMPTY,
            f"{count} training prompts remain after filtering, fewer than "
            f"data.train_batch_size={cfg.data.train_batch_size}",
            whole_batches(
                count,
                "actor_rollout_ref.actor.ppo_mini_batch_size",
                cfg.actor_rollout_ref.actor.ppo_mini_batch_size,
            ),
        )


def total_steps(cfg: KeelConfig, batches_per_epoch: int) -> int:
    return cfg.trainer.total_training_steps or cfg.trainer.total_epochs * batches_per_epoch


def build_inputs(cfg: KeelConfig, plan: Plan) -> Inputs:
    """Tokenizer, prompts and reward, each failing with its code on bad input, and checked against
    each other as `keel check` checks them (enough prompts, a scorer for every row)."""
    model_cfg = cfg.actor_rollout_ref.model
    tokenizer = load_tokenizer(model_cfg.path, model_cfg.trust_remote_code)
    reward = build_reward(cfg, plan)
    agent = cfg.actor_rollout_ref.rollout.agent
    train = load_prompts(cfg.data.train_files, tokenizer, cfg, "train")
    val = (
        load_prompts(cfg.data.val_files, tokenizer, cfg, "val")
        if cfg.data.val_files or agent.environment
        else []
    )
    # an environment's rewards are its own, whatever the rows' data_source
    if not agent.environment:
        reward.check_records(train + val, [*cfg.data.train_files, *cfg.data.val_files])
    require_enough_prompts(len(train), cfg)
    return Inputs(tokenizer, train, val, reward)


def build_components(
    cfg: KeelConfig,
    actor_weights: Path | None = None,
    inputs: Inputs | None = None,
    plan: Plan | None = None,
) -> Components:
    """`actor_weights`: a checkpoint's actor directory to start from instead of the model path.
    `inputs`: what `keel check` already loaded and checked (tokenizer, datasets, reward), reused as
    it is. `plan`: keel's decisions for the config (`load_run`'s, or `keel check`'s); None: the
    config's own, as written."""
    quiet_transformers()
    seed_everything(cfg.trainer.seed)
    # a missing device fails here, before any model loads
    resolve_device(cfg.trainer.device)
    plan = plan or plan_of(cfg)
    inputs = inputs or build_inputs(cfg, plan)
    tokenizer, reward = inputs.tokenizer, inputs.reward
    train_data, val_data = inputs.train_records, inputs.val_records
    if cfg.critic.enable and not ADV_ESTIMATORS[cfg.algorithm.adv_estimator].needs_critic:
        log.warning(
            "critic.enable=true with algorithm.adv_estimator=%s, which does not use values: the "
            "critic is trained but nothing reads it",
            cfg.algorithm.adv_estimator,
        )
    norm = cfg.reward.normalize
    sampler = ResumableSampler(
        len(train_data), cfg.data.train_batch_size, cfg.data.seed, cfg.data.shuffle
    )
    steps = total_steps(cfg, sampler.batches_per_epoch)

    # before any worker starts: they all build the same layout
    plan = decide_sharding(cfg, plan)
    if plan.sharding:
        log.info("sharding: %s", plan.sharding.why)
    workers = build_workers(cfg, plan, steps, actor_weights, tokenizer, cfg.run_dir)
    return Components(
        plan=plan,
        tokenizer=tokenizer,
        train_data=train_data,
        val_data=val_data,
        sampler=sampler,
        workers=workers,
        reward=reward,
        kl_ctrl=make_kl_controller(
            cfg.algorithm.kl_ctrl.type,
            cfg.algorithm.kl_ctrl.kl_coef,
            cfg.algorithm.kl_ctrl.target_kl,
            cfg.algorithm.kl_ctrl.horizon,
        ),
        normalizer=RunningNormalizer(norm.window_size, norm.eps, norm.clip)
        if norm.enable
        else None,
        total_steps=steps,
    )


def build_workers(
    cfg: KeelConfig,
    plan: Plan,
    total_steps: int,
    actor_weights: Path | None,
    tokenizer,
    run_dir: str | Path,
) -> WorkerRoles:
    """One worker in this process, or `trainer.n_gpus_per_node x trainer.nnodes` Ray workers."""
    weights = str(actor_weights) if actor_weights else None
    # With a pool of its own for any role, Ray places every device user, a single worker included.
    if cfg.world_size == 1 and not cfg.pools:
        group = LocalGroup(
            RoleWorker(WorkerSpec.of(cfg, total_steps, weights, plan=plan), tokenizer=tokenizer)
        )
    else:
        log.info(
            "starting %d workers (trainer.n_gpus_per_node=%d x trainer.nnodes=%d)",
            cfg.world_size,
            cfg.trainer.n_gpus_per_node,
            cfg.trainer.nnodes,
        )
        group = role_group(cfg, total_steps, weights, Path(run_dir), plan=plan)
    # the critic's and the teacher's own workers, where they have pools of their own
    critic_group = _pool_group(cfg, "critic", "critic", total_steps, run_dir, plan)
    teacher_group = _pool_group(cfg, "teacher", "distillation.teacher", total_steps, run_dir, plan)
    rollout = None
    if "rollout" in cfg.pools:
        log.info(
            "starting %d rollout workers (actor_rollout_ref.hybrid_engine=false: "
            "rollout.n_gpus_per_node=%d x rollout.nnodes=%d)",
            cfg.pools["rollout"],
            cfg.actor_rollout_ref.rollout.n_gpus_per_node,
            cfg.actor_rollout_ref.rollout.nnodes,
        )
        rollout = rollout_group(cfg, total_steps, weights, Path(run_dir), plan)
    return WorkerRoles.of(group, cfg, tokenizer.pad_token_id, critic_group, rollout, teacher_group)


def _pool_group(cfg: KeelConfig, role: str, key: str, total_steps: int, run_dir, plan: Plan):
    """The RoleWorkers of `role` alone on its own pool (section `key`); None without one."""
    if role not in cfg.pools:
        return None
    log.info("starting %d %s workers (%s.enable_resource_pool)", cfg.pools[role], role, key)
    return role_group(
        cfg,
        total_steps,
        None,
        Path(run_dir),
        roles=frozenset({role}),
        world_size=cfg.pools[role],
        plan=plan,
    )


def build_reward(cfg: KeelConfig, plan: Plan) -> RewardScorer:
    """The scorer, in the plan's reward.num_workers processes."""
    custom, r, rm = cfg.custom_reward_function, cfg.reward, cfg.reward_model
    service = None
    if r.service.url:
        s = r.service
        service = RewardServiceClient(s.url, s.timeout_s, s.retry_times, s.retry_delay_s, s.token)
        # the client does not know the scorer; the config names it
        service.check_health(serve_fix(cfg))
    reward_model = None
    if rm.enable and rm.enable_resource_pool:
        reward_model = RewardModelPool.of(cfg)
    elif rm.enable:
        reward_model = RewardModel(
            rm.model.path,
            resolve_device(cfg.trainer.device),
            rm.micro_batch_size_per_gpu,
            rm.max_length,
            rm.model.trust_remote_code,
        )
    scorer = None
    if custom.path:
        # a broken file, or a function verl's keyword call cannot bind, fails now
        scorer = load_custom_reward_fn(
            custom.path, custom.name, custom.reward_kwargs, custom.batched
        )
        # workers import it themselves
        if plan.reward_workers > 0 and not custom.batched:
            scorer = file_spec(module_location(custom.path), custom.name, custom.reward_kwargs)
    return RewardScorer(
        scorer,
        r.scorers,
        r.overlong_buffer,
        cfg.data.max_response_length,
        r.on_error,
        r.max_not_scored_ratio,
        r.timeout_s,
        plan.reward_workers,
        custom.batched,
        reward_model,
        service,
        r.sandbox.require,
        cfg.trainer.guards.nonfinite,
    )


def serve_fix(cfg: KeelConfig) -> str:
    """The command that serves the config's scorer where reward.service.url points."""
    from urllib.parse import urlparse

    url, custom = urlparse(cfg.reward.service.url), cfg.custom_reward_function
    scorer = f"--custom {custom.path}:{custom.name}" if custom.path else "--scorer exact_match"
    token = " --token TOKEN (reward.service.token's)" if cfg.reward.service.token else ""
    start = f"keel reward-server {scorer} --host {url.hostname} --port {url.port or 80}"
    return (
        f"start the service: `{start}`{token}, or {setting('reward.service.url', None)} to score "
        "in this process"
    )


def needs_baseline_rollout(cfg: KeelConfig) -> bool:
    return ADV_ESTIMATORS[cfg.algorithm.adv_estimator].needs_baseline
