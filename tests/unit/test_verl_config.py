"""A verl user's config works on keel: every verl key is honoured, accepted (keel does it another
way, and says so) or refused by name (KEEL-C015); verl's defaults, references and command-line
forms are taken; every problem of a config is reported at once; no suggestion changes meaning."""

from pathlib import Path

import pytest
import yaml

from keel.config.load import all_keys, load_config, load_run
from keel.errors import UNKNOWN_KEY, VERL_UNSUPPORTED, KeelError

VERL_YAML = Path(__file__).parents[1] / "data" / "verl_ppo_trainer.yaml"
REQUIRED = {"data.train_files": ["train.parquet"], "actor_rollout_ref.model.path": "model"}
SMALL = {
    **REQUIRED,
    "data.train_batch_size": 8,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
    "trainer.n_gpus_per_node": 1,
}


def verl_leaves() -> dict:
    leaves = {}

    def walk(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}.")
            else:
                leaves[f"{prefix}{key}"] = value

    walk(yaml.safe_load(VERL_YAML.read_text()))
    return leaves


def error_of(overrides, base=None) -> KeelError:
    with pytest.raises(KeelError) as info:
        load_config(base or {}, {**SMALL, **overrides})
    return info.value


def test_verls_whole_generated_config_loads_with_its_own_defaults():
    leaves = verl_leaves()
    assert len(leaves) > 500
    cfg, plan = load_run(yaml.safe_load(VERL_YAML.read_text()), SMALL)
    assert cfg.algorithm.critic_warmup == 0 and cfg.actor_rollout_ref.actor.grad_clip == 1.0
    # its ${...} references resolved
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"
    assert cfg.critic.loss_agg_mode == cfg.actor_rollout_ref.actor.loss_agg_mode
    # verl's null: keel's default
    assert cfg.trainer.logger == ["console", "wandb"] and cfg.data.seed == 1
    # said, not silent
    assert any("tensor_model_parallel_size" in line for line in plan.decided)


def test_every_verl_leaf_is_known_by_name():
    """Each leaf alone, with verl's default: never the generic unknown-key error."""
    unknown = []
    for key, value in verl_leaves().items():
        try:
            load_config({}, {**SMALL, key: value})
        except KeelError as error:
            if error.code == UNKNOWN_KEY or "unknown config key" in error.message:
                unknown.append(key)
    assert not unknown, f"verl keys keel does not know: {unknown}"
    # and many are keel's own
    assert len(set(verl_leaves()) & set(all_keys())) > 100


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("actor_rollout_ref.actor.ulysses_sequence_parallel_size", 2, "sequence parallelism"),
        ("actor_rollout_ref.actor.strategy", "megatron", "Megatron"),
        ("critic.model.enable_activation_offload", True, "activation"),
        ("reward_model.sandbox_fusion.url", "http://sandbox:8080", "SandboxFusion"),
        ("reward_model.reward_manager", "limited", "reward manager"),
        ("actor_rollout_ref.actor.ppo_micro_batch_size", 32, "ppo_micro_batch_size_per_gpu"),
    ],
)
def test_what_keel_does_not_have_is_refused_by_name(key, value, needle):
    error = error_of({key: value})
    assert error.code == VERL_UNSUPPORTED and key in error.message and needle in error.message


def test_every_problem_of_a_config_is_reported_at_once():
    error = error_of(
        {
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2,
            "data.max_prompt_length": "long",
            "trainer.save_frequency": 5,
        }
    )
    assert "3 problems" in error.message
    for code in ("KEEL-C015", "KEEL-C002", "KEEL-C001"):
        assert f"error[{code}]" in error.message


def test_suggestions_are_misspellings_never_another_setting():
    # accepted: keel's way
    assert load_config({}, {**SMALL, "actor_rollout_ref.model.use_remove_padding": True})
    error = error_of({"actor_rollout_ref.model.use_remove_paddin": True})
    # not trust_remote_code
    assert error.code == UNKNOWN_KEY and "did you mean" not in error.message
    cfg = load_config({}, {**SMALL, "actor_rollout_ref.actor.optim.clip_grad": 0.5})
    # not lr
    assert (
        cfg.actor_rollout_ref.actor.grad_clip == 0.5
        and cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    )
    assert "did you mean 'trainer.save_freq'" in error_of({"trainer.sav_freq": 2}).message


def test_verls_command_line_forms(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg, plan = load_run(
        None,
        [
            "data.train_files=~/data/train.parquet",
            "actor_rollout_ref.model.path=m",
            "+trainer.critic_warmup=3",
            "++data.seed=7",
            "trainer.logger=['console','wandb']",
            "actor_rollout_ref.rollout.name=vllm",
            "~trainer.val_before_train",
        ],
    )
    assert cfg.data.train_files == [f"{tmp_path}/data/train.parquet"]
    assert (
        cfg.algorithm.critic_warmup == 3
        and cfg.data.seed == 7
        and cfg.trainer.logger == ["console", "wandb"]
    )
    assert cfg.actor_rollout_ref.rollout.name == "auto" and any(
        "no vLLM" in line for line in plan.decided
    )


def test_values_verl_derives_from_the_actors_follow_them():
    cfg = load_config(
        {},
        {
            **SMALL,
            "actor_rollout_ref.actor.use_dynamic_bsz": True,
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 4096,
            "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean",
        },
    )
    rollout, ref = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref
    assert rollout.log_prob_use_dynamic_bsz and ref.log_prob_use_dynamic_bsz
    assert rollout.log_prob_max_token_len_per_gpu == ref.log_prob_max_token_len_per_gpu == 4096
    assert cfg.critic.loss_agg_mode == "seq-mean-token-mean"


def test_keel_train_takes_a_verl_script_without_a_config_file(tiny_config, tmp_path):
    from keel.cli import main
    from keel.config.load import flatten

    flat = {k: v for k, v in flatten(tiny_config).items() if v not in ([], None)}
    overrides = [
        f"{k}={v}" if not isinstance(v, list) else f"{k}=[{','.join(map(str, v))}]"
        for k, v in flat.items()
    ]
    assert (
        main(
            [
                "check",
                *overrides,
                "actor_rollout_ref.model.use_remove_padding=True",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            ]
        )
        == 0
    )


def test_verls_reward_managers_are_keels_settings():
    dapo = load_config(
        {},
        {
            **SMALL,
            "reward_model.reward_manager": "dapo",
            "data.max_response_length": 512,
            "+reward_model.reward_kwargs.overlong_buffer_cfg.enable": True,
            "+reward_model.reward_kwargs.overlong_buffer_cfg.len": 128,
            "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": 0.5,
            "+reward_model.reward_kwargs.max_resp_len": 512,
        },
    )
    assert dapo.reward.overlong_buffer.enable and dapo.reward.overlong_buffer.len == 128
    assert dapo.reward.overlong_buffer.penalty_factor == 0.5
    batch = load_config(
        {}, {**SMALL, "reward_model.reward_manager": "batch", "custom_reward_function.path": "r.py"}
    )
    assert batch.custom_reward_function.batched
    assert (
        load_config({}, {**SMALL, "reward_model.reward_manager": "prime"}).reward.num_workers >= 1
    )
    error = error_of(
        {"reward_model.reward_manager": "dapo", "reward_model.reward_kwargs.max_resp_len": 100}
    )
    assert error.code == VERL_UNSUPPORTED and "max_resp_len" in error.message


def test_critic_warmup_counts_as_verls(tiny_config):
    """verl updates the actor once `critic_warmup <= step` (steps count from 1): 2 means one step
    of the critic alone."""
    from keel.api import train

    tiny_config["algorithm"]["adv_estimator"] = "gae"
    tiny_config["trainer"].update({"critic_warmup": 2, "test_freq": -1, "val_before_train": False})
    result = train(tiny_config)
    import json

    steps = [
        json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert ["actor/pg_loss" in m for m in steps] == [False, True] and all(
        "critic/vf_loss" in m for m in steps
    )


def test_references_to_unset_keys_take_keels_defaults_and_parents_resolve(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    tree = {
        "trainer": {"default_local_dir": "ck/${trainer.project_name}"},
        "actor_rollout_ref": {"rollout": {"max_model_len": "${..actor.ppo_max_token_len_per_gpu}"}},
        "reward_model": {"reward_kwargs": {}},
    }
    cfg = load_config(
        tree, {**SMALL, "data.val_files": ["~/val.parquet"], "~trainer.save_freq": None}
    )
    # keel's default project name, not "None"
    assert cfg.trainer.default_local_dir == "ck/keel"
    # a parent's key, and keel's default there
    assert cfg.actor_rollout_ref.rollout.max_model_len == 16384
    assert cfg.data.val_files == [f"{tmp_path}/val.parquet"]


def test_a_custom_reward_manager_from_a_file_is_refused():
    error = error_of(
        {"reward_manager.source": "importlib", "reward_manager.module.path": "my_manager.py"}
    )
    assert error.code == VERL_UNSUPPORTED and "reward_manager.source" in error.message


@pytest.mark.parametrize(
    "preset",
    # verl's RolloutCorrectionConfig presets, as a script writes them
    [
        # decoupled_token_is
        {"rollout_is": "token", "rollout_is_threshold": 2.0},
        # seq MIS
        {"rollout_is": "sequence", "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0"},
        # geo RS + token TIS
        {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": 1.001, "rollout_is": "token"},
        # bypass_ppo_clip
        {"bypass_mode": True},
        # bypass + K3-RS
        {"bypass_mode": True, "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01},
        # bypass_pg_is
        {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "sequence"},
    ],
)
def test_verls_rollout_correction_presets_load(preset):
    cfg = load_config(
        {}, {**SMALL, **{f"algorithm.rollout_correction.{k}": v for k, v in preset.items()}}
    )
    rc = cfg.algorithm.rollout_correction
    params = rc.params()
    assert params.is_level is not None or params.rejection or rc.bypass_mode
    assert rc.decoupled != rc.bypass_mode


@pytest.mark.parametrize(
    "overrides, code, needle",
    [
        ({"rollout_rs": "seq_k1", "rollout_rs_threshold": 2}, "KEEL-C002", "not among"),
        ({"rollout_rs": "token_k1"}, "KEEL-C002", "rollout_rs_threshold is not"),
        ({"rollout_is": "tokens"}, "KEEL-C002", "one of"),
        ({"rollout_is_threshold": 0}, "KEEL-C002", "> 0"),
        ({"loss_type": "reinforce"}, "KEEL-C006", "bypass_mode"),
        ({"bypass_mode": True, "rollout_is": "token"}, "KEEL-C006", "never applies them"),
        (
            {
                "bypass_mode": True,
                "loss_type": "reinforce",
                "rollout_is": "token",
                "actor_rollout_ref.actor.policy_loss.loss_mode": "gspo",
            },
            "KEEL-C006",
            "sets the policy loss",
        ),
        (
            {"bypass_mode": True, "actor_rollout_ref.actor.policy_loss.loss_mode": "cispo"},
            "KEEL-C006",
            "sets the policy loss",
        ),
        (
            {
                "bypass_mode": True,
                "loss_type": "reinforce",
                "rollout_is": "token",
                "rollout_is_batch_normalize": True,
            },
            "KEEL-C006",
            "depend on how the batch is cut",
        ),
        (
            {
                "rollout_is": "token",
                "actor_rollout_ref.rollout.do_sample": False,
                "actor_rollout_ref.rollout.n": 1,
            },
            "KEEL-C006",
            "greedy",
        ),
    ],
)
def test_a_rollout_correction_that_cannot_work_is_refused(overrides, code, needle):
    keys = {k if "." in k else f"algorithm.rollout_correction.{k}": v for k, v in overrides.items()}
    if keys.get("actor_rollout_ref.rollout.n") == 1:
        keys["algorithm.adv_estimator"] = "gae"
        keys["critic.enable"] = True
    error = error_of(keys)
    assert f"error[{code}]" in error.render()
    assert needle in error.message, error.message
