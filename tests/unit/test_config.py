"""Config loading: verl key names, overrides, typed validation, the batch plan."""

import pytest

from keel.config.load import all_keys, load_config, load_run
from keel.config.plan import make_plan
from keel.errors import (
    BAD_OVERRIDE,
    BAD_VALUE,
    BATCH_ARITHMETIC,
    CONFIG_FILE,
    INCOMPATIBLE_OPTIONS,
    TOKEN_BUDGET,
    UNKNOWN_KEY,
    KeelError,
)
from keel.types import OldLogProbSource

BASE = {"data": {"train_files": ["train.jsonl"]}, "actor_rollout_ref": {"model": {"path": "model"}}}


def error_of(overrides, base=BASE) -> KeelError:
    with pytest.raises(KeelError) as info:
        load_config(base, overrides)
    return info.value


def test_yaml_file_and_overrides_use_verl_names(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "data:\n  train_files: [a.parquet]\n  train_batch_size: 16\nactor_rollout_ref:\n  "
        "model: {path: m}\n"
    )
    cfg = load_config(
        path,
        [
            "actor_rollout_ref.rollout.n=4",
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.optim.lr=1e-5",
            "trainer.logger=[console]",
        ],
    )
    assert cfg.data.train_batch_size == 16
    assert cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.algorithm.adv_estimator == "grpo"
    # YAML reads 1e-5 as a string; coerced
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-5
    assert cfg.trainer.logger == ["console"]
    # grpo needs no critic
    assert not cfg.critic_enabled


@pytest.mark.parametrize(
    "override, suggestion",
    [
        (
            "actor_rollout_ref.actor.ppo_mini_batch_szie=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size",
        ),
        ("trainer.sav_freq=2", "trainer.save_freq"),
        # section left out
        ("actor.ppo_epochs=2", "actor_rollout_ref.actor.ppo_epochs"),
    ],
)
def test_unknown_key_names_the_closest_valid_key(override, suggestion):
    err = error_of([override])
    assert err.code == UNKNOWN_KEY
    assert f"did you mean {suggestion!r}" in err.message


@pytest.mark.parametrize(
    "override",
    ["actor_rollout_ref.ref.nnodes=2", "actor_rollout_ref.ref.enable_resource_pool=true"],
)
def test_placing_the_reference_apart_from_the_actor_is_refused_with_the_reason(override):
    from keel.errors import REFERENCE_APART

    err = error_of([override])
    assert err.code == REFERENCE_APART
    assert "token by token" in err.message and "param_offload" in err.fix


@pytest.mark.parametrize(
    "override, needle",
    [
        ("data.max_prompt_length=abc", "must be an integer"),
        ("data.max_prompt_length=0", "must be > 0"),
        ("trainer.device=tpu", "not one of"),
        ("data.truncation=middle", "not one of"),
        ("actor_rollout_ref.actor.optim.lr=fast", "must be a number"),
        ("data.shuffle=maybe", "true or false"),
        (
            "trainer.logger=[console,neptune]",
            "'neptune' is not one of",
            # never silently dropped (verl's swanlab: KEEL-C015)
        ),
        ("trainer.seed=-1", "must be >= 0"),
        ("actor_rollout_ref.actor.optim.betas=[0.9]", "two numbers in [0, 1)"),
    ],
)
def test_bad_values_are_rejected_with_what_to_set(override, needle):
    err = error_of([override])
    assert err.code == BAD_VALUE
    assert needle in err.message
    assert override.split("=")[0] in err.fix


def test_malformed_override():
    assert error_of(["data.train_batch_size"]).code == BAD_OVERRIDE


def test_missing_or_invalid_config_file(tmp_path):
    assert error_of(None, base=str(tmp_path / "nope.yaml")).code == CONFIG_FILE
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    assert error_of(None, base=str(bad)).code == CONFIG_FILE


def test_batch_arithmetic_names_the_numbers():
    err = error_of(["data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    assert err.code == BATCH_ARITHMETIC
    assert "data.train_batch_size=6" in err.message and "ppo_mini_batch_size=4" in err.message
    # the largest divisor of 6 not above 4
    assert "`actor_rollout_ref.actor.ppo_mini_batch_size=3`" in err.fix

    err = error_of(
        [
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.rollout.n=3",
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        ]
    )
    # 2 prompts x n=3 = 6 samples per mini-batch, not a multiple of 4
    assert err.code == BATCH_ARITHMETIC and "6 samples" in err.message


@pytest.mark.parametrize(
    "overrides",
    [
        # n=1: every group advantage would be 0
        ["algorithm.adv_estimator=grpo"],
        ["algorithm.adv_estimator=gae", "critic.enable=false"],
        # 3 does not divide 2
        ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.fsdp_config.fsdp_size=3"],
        [
            "trainer.n_gpus_per_node=2",
            # no FSDP to offload
            "actor_rollout_ref.actor.fsdp_config.fsdp_size=1",
            "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        ],
        ["algorithm.adv_estimator=remax", "actor_rollout_ref.rollout.do_sample=false"],
        [
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=2",
            "algorithm.critic_warmup=3",
        ],
        # four identical greedy answers
        ["actor_rollout_ref.rollout.val_kwargs.n=4"],
        # with temperature 0
        ["actor_rollout_ref.rollout.val_kwargs.do_sample=true"],
        # no reward model to place
        ["reward_model.enable_resource_pool=true"],
        # a 1024-token prompt fits no 512-token prefill pass without chunked prefill
        [
            "data.max_prompt_length=1024",
            "actor_rollout_ref.rollout.max_num_batched_tokens=512",
            "actor_rollout_ref.rollout.enable_chunked_prefill=false",
        ],
        # two things answering the same turns
        [
            "actor_rollout_ref.rollout.multi_turn.environment=games.py:Game",
            "actor_rollout_ref.rollout.multi_turn.interaction_config_path=users.yaml",
        ],
    ],
)
def test_incompatible_options(overrides):
    assert error_of(overrides).code == INCOMPATIBLE_OPTIONS


def test_max_model_len_shorter_than_prompt_plus_response_is_refused():
    error = error_of(
        [
            "data.max_prompt_length=512",
            "data.max_response_length=512",
            "actor_rollout_ref.rollout.max_model_len=1000",
        ]
    )
    assert error.code == TOKEN_BUDGET and "1024" in str(error)
    ok = load_config(
        BASE,
        [
            "data.max_prompt_length=512",
            "data.max_response_length=512",
            "actor_rollout_ref.rollout.max_model_len=1024",
        ],
    )
    assert ok.actor_rollout_ref.rollout.max_model_len == 1024


def test_batch_plan_counts():
    cfg = load_config(
        BASE,
        [
            "data.train_batch_size=8",
            "actor_rollout_ref.rollout.n=4",
            "algorithm.adv_estimator=gae",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.ppo_epochs=2",
            "data.max_prompt_length=10",
            "data.max_response_length=6",
        ],
    )
    plan = make_plan(cfg)
    assert plan.prompts_per_step == 8
    # 8 prompts x n=4
    assert plan.samples_per_step == 32
    # 8 / 2 prompts
    assert plan.actor.mini_batches == 4
    # 2 prompts x 4
    assert plan.actor.samples_per_mini_batch == 8
    # 8 / 4
    assert plan.actor.micro_batches_per_mini_batch == 2
    two = make_plan(
        load_config(
            BASE,
            [
                "data.train_batch_size=8",
                "actor_rollout_ref.rollout.n=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            ],
        )
    )
    assert (two.workers, two.actor.samples_per_worker, two.actor.micro_batches_per_mini_batch) == (
        2,
        4,
        1,
    )
    # 4 mini-batches x 2 epochs
    assert plan.actor.optimizer_steps_per_rollout == 8
    # gae has a critic, with the actor's sizes
    assert plan.critic is not None
    # samples x (10 + 6)
    assert plan.max_tokens_per_step == 32 * 16
    assert "samples per step (x rollout.n)" in plan.render()
    # 4 mini-batches
    assert plan.old_log_probs == "recomputed each step"


@pytest.mark.parametrize(
    "overrides, source",
    [
        (["actor_rollout_ref.actor.ppo_mini_batch_size=8"], "on-policy"),
        (
            ["actor_rollout_ref.actor.ppo_mini_batch_size=8", "algorithm.use_kl_in_reward=true"],
            "recomputed",
        ),
        (
            ["actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.guards.nonfinite=skip"],
            "recomputed",
        ),
        (
            [
                "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                "algorithm.rollout_correction.rollout_is=token",
            ],
            "recomputed",
        ),
        (
            [
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "algorithm.rollout_correction.bypass_mode=true",
            ],
            "sampler's",
        ),
        (["actor_rollout_ref.actor.ppo_mini_batch_size=4"], "but the first mini-batch's"),
        # async mode's samples are off-policy: keel's bypass mode takes the sampler's as the old
        # ones, and decoupled correction (chosen, or for a policy loss bypass mode cannot take)
        # needs every old log-prob
        (["actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.mode=async"], "sampler's"),
        (
            [
                "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                "trainer.mode=async",
                "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
            ],
            "recomputed each step",
        ),
        (
            [
                "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                "trainer.mode=async",
                "trainer.max_off_policy_steps=0",
            ],
            "on-policy",
        ),
    ],
)
def test_the_plan_says_where_the_old_log_probs_come_from(overrides, source):
    plan = make_plan(*load_run(BASE, ["data.train_batch_size=8", *overrides]))
    assert source in plan.old_log_probs and source in plan.render()


# its first mini-batch runs after optimiser steps
def test_a_second_epoch_needs_every_old_log_prob():
    plan = make_plan(
        load_config(
            BASE,
            [
                "data.train_batch_size=8",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "actor_rollout_ref.actor.ppo_epochs=2",
            ],
        )
    )
    assert plan.old_log_probs == "recomputed each step"


def test_every_key_is_reachable():
    keys = all_keys()
    assert "actor_rollout_ref.actor.policy_loss.loss_mode" in keys
    assert "algorithm.kl_ctrl.kl_coef" in keys
    assert len(keys) == len(set(keys))


def test_config_reference_lists_every_key():
    from pathlib import Path

    from keel.config.docs import render_reference

    doc = Path(__file__).parents[2] / "docs" / "config.md"
    assert doc.read_text() == render_reference(), (
        "regenerate: python -m keel.config.docs > docs/config.md"
    )
    assert all(f"`{key}`" in doc.read_text() for key in all_keys())
    # the SFT keys too
    assert "`model.partial_pretrain`" in doc.read_text()


def test_token_budget_smaller_than_one_sample_is_refused():
    err = error_of(
        [
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10",
        ]
    )
    assert err.code == BATCH_ARITHMETIC and "ppo_max_token_len_per_gpu=10" in err.message
    assert "at least" in err.fix


def test_more_workers_than_samples_in_a_mini_batch_is_refused():
    # BASE: mini-batches of 4 prompts x n=1
    err = error_of(["trainer.n_gpus_per_node=8"])
    assert err.code == BATCH_ARITHMETIC and "8 workers" in err.message


@pytest.mark.parametrize(
    "shape, gpu_gb, overrides, expected, size",
    [
        # a replica fits an H200 with room: replicated
        ("0.5b", 140, [], "DDP", 1),
        # it does not: sharded over every worker
        ("7b", 140, [], "would need about", -1),
        # nothing to size it against: sharded, as before
        ("0.5b", None, [], "no GPU here", -1),
        # it would generate
        ("0.5b", 140, ["actor_rollout_ref.rollout.name=hf"], "rollout engine is hf", -1),
        # the config says: as it is
        ("0.5b", 140, ["actor_rollout_ref.actor.fsdp_config.fsdp_size=-1"], None, -1),
        # FSDP's keys: FSDP
        ("0.5b", 140, ["actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"], None, -1),
        # one worker: nothing to pick
        ("0.5b", 140, ["trainer.n_gpus_per_node=1"], None, -1),
    ],
)
def test_keel_picks_ddp_or_fsdp_for_the_policy_when_the_config_does_not(
    shape, gpu_gb, overrides, expected, size
):
    from transformers import Qwen2Config

    from keel.bench.workloads import QWEN25_COMMON, QWEN25_SHAPES
    from keel.models.load import meta_model
    from keel.trainer.sharding import choose_sharding

    cfg, plan = load_run(BASE, ["trainer.n_gpus_per_node=2"] + overrides)
    written = cfg.actor_rollout_ref.actor.fsdp_config.fsdp_size
    model_cfg = Qwen2Config(**QWEN25_COMMON, **QWEN25_SHAPES[shape])
    params = sum(p.numel() for p in meta_model(model_cfg).parameters())
    sharding = choose_sharding(cfg, plan, model_cfg, params, gpu_gb and gpu_gb * 2**30)
    why = sharding and sharding.why
    assert (why is None) if expected is None else (expected in why and "fsdp_size" in why)
    plan = plan.with_sharding(sharding)
    assert plan.actor_fsdp(cfg).fsdp_size == plan.policy(cfg).actor.fsdp_config.fsdp_size == size
    # the config stays what the user wrote
    assert cfg.actor_rollout_ref.actor.fsdp_config.fsdp_size == written
    # chosen once: keel check's stands for the run
    assert choose_sharding(cfg, plan, model_cfg, params, 1) == sharding


@pytest.mark.parametrize(
    "overrides, said",
    [
        (
            [],
            "in the trainer's process, each batch whole (set reward.num_workers > 0 to score "
            "beside generation)",
        ),
        (
            ["reward.num_workers=4"],
            "in 4 scoring processes, each sample as it finishes, beside generation",
        ),
        (
            ["reward.num_workers=4", "reward.score_ahead=false"],
            "in 4 scoring processes, each batch whole",
        ),
        (
            ["reward.num_workers=4", "custom_reward_function.batched=true"],
            "by your batched function, each batch",
        ),
        (
            ["reward.num_workers=4", "actor_rollout_ref.rollout.name=hf"],
            "in 4 scoring processes, each batch whole",
        ),
        (
            ["reward.num_workers=4", "actor_rollout_ref.rollout.multi_turn.enable=true"],
            "in 4 scoring processes, each sample as it finishes, beside generation (episodes "
            "with an environment",
        ),
    ],
)
def test_the_plan_says_where_and_when_samples_are_scored(tiny_config, overrides, said):
    plan = make_plan(*load_run(tiny_config, overrides))
    assert plan.rewards.startswith(said) and f"rewards: {plan.rewards}" in plan.summary()


@pytest.mark.parametrize(
    "overrides, ahead, bound",
    [
        ([], False, 0),
        # sync: nothing runs ahead, whatever the bound says
        (["trainer.max_off_policy_steps=3"], False, 0),
        (["trainer.mode=async"], True, 1),
        (["trainer.mode=async", "trainer.max_off_policy_steps=0"], True, 0),
        (["trainer.mode=async", "trainer.max_off_policy_steps=2"], True, 2),
    ],
)
def test_the_off_policy_keys_are_one_value_whose_bound_0_is_sync(overrides, ahead, bound):
    cfg, plan = load_run(BASE, overrides)
    assert plan.off_policy == cfg.trainer.off_policy
    assert (plan.off_policy.ahead, plan.off_policy.bound) == (ahead, bound)
    assert plan.off_policy.name == ("async" if ahead else "sync")


def test_keels_decisions_are_the_plans_and_the_config_stays_as_written():
    written = ["trainer.mode=async", "trainer.n_gpus_per_node=2"]
    cfg, plan = load_run(BASE, written)
    assert plan.rollout_correction.bypass_mode and plan.reward_workers >= 1
    assert plan.old_log_probs is OldLogProbSource.SAMPLER
    assert "trainer.mode" in plan.given and plan.decided
    # what the user wrote, nothing added
    assert cfg == load_config(BASE, written)
    assert not cfg.algorithm.rollout_correction.bypass_mode and cfg.reward.num_workers == 0
    assert not hasattr(cfg, "decided") and not hasattr(cfg, "given")
    # a config object sets every key: nothing is left to keel
    as_built = load_run(cfg).plan
    assert as_built.given is not None and not as_built.rollout_correction.bypass_mode
