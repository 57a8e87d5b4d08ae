"""Keys of verl releases from 0.4 on that later releases renamed: taken under the new name (and
`keel check` says so) where the numbers are the same, refused by name with the new key where not;
verl 0.9.1's whole trainer config loads; verl's trackers keel has no sink for are refused by
name."""

import pytest
import yaml

from keel.config.hydra_compose import KEEL_COPY
from keel.config.load import load_config, load_run
from keel.errors import UNKNOWN_KEY, VERL_UNSUPPORTED, KeelError

SMALL = {
    "data.train_files": ["train.parquet"],
    "actor_rollout_ref.model.path": "model",
    "data.train_batch_size": 8,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
    "trainer.n_gpus_per_node": 1,
}
NEW = "algorithm.rollout_correction."


def loaded(overrides: dict, base: dict | None = None):
    """The config and keel's plan for it."""
    return load_run(base or {}, {**SMALL, **overrides})


def refused(overrides: dict) -> KeelError:
    with pytest.raises(KeelError) as info:
        loaded(overrides)
    return info.value


def said(plan, *words: str) -> bool:
    return any(all(w in line for w in words) for line in plan.decided)


def test_verl_0_6_0s_rollout_is_family_is_rollout_correction():
    cfg, plan = loaded(
        {
            "algorithm.rollout_is": True,
            "algorithm.rollout_is_threshold": 3.0,
            "algorithm.rollout_is_level": "sequence",
            "algorithm.rollout_is_mode": "truncate",
        }
    )
    correction = cfg.algorithm.rollout_correction
    assert (correction.rollout_is, correction.rollout_is_threshold) == ("sequence", 3.0)
    assert said(plan, "verl 0.6.0", f"{NEW}rollout_is=sequence", "veto")
    cfg, plan = loaded(
        {
            "algorithm.rollout_is": True,
            "algorithm.rollout_is_threshold": 2.0,
            "algorithm.rollout_is_veto_threshold": None,
        }
        # the level's default: token
    )
    assert cfg.algorithm.rollout_correction.rollout_is == "token"


def test_rollout_is_false_or_no_threshold_applies_no_weights_as_in_verl_0_6_0():
    for overrides in (
        {"algorithm.rollout_is": False, "algorithm.rollout_is_threshold": 2.0},
        {"algorithm.rollout_is": True, "algorithm.rollout_is_threshold": None},
    ):
        cfg, plan = loaded(overrides)
        assert cfg.algorithm.rollout_correction.rollout_is is None
        assert said(plan, "no weights applied")


@pytest.mark.parametrize(
    "key, value, new",
    [
        ("algorithm.rollout_is_mode", "mask", f"{NEW}rollout_rs"),
        ("algorithm.rollout_is_level", "geometric", f"{NEW}rollout_rs=seq_mean_k1"),
        ("algorithm.rollout_is_veto_threshold", 1e-4, f"{NEW}rollout_rs=token_k1"),
    ],
)
def test_a_rollout_is_setting_with_other_numbers_now_is_refused_with_the_new_key(key, value, new):
    error = refused(
        {"algorithm.rollout_is": True, "algorithm.rollout_is_threshold": 2.0, key: value}
    )
    assert error.code == VERL_UNSUPPORTED and key in error.message and new in error.message
    assert error.fix.startswith(f"remove `{key}`")


@pytest.mark.parametrize(
    "level, option",
    [("token", "token_k1"), ("sequence", "seq_sum_k1"), ("geometric", "seq_mean_k1")],
)
def test_verl_0_7_0s_rejection_levels_are_k1_options_with_the_same_band(level, option):
    import torch

    from keel.algorithms.rollout_correction import _kept_by

    cfg, plan = loaded(
        {
            f"{NEW}rollout_rs": level,
            f"{NEW}rollout_rs_threshold": 1.5,
            f"{NEW}rollout_rs_threshold_lower": 0.8,
        }
    )
    correction = cfg.algorithm.rollout_correction
    assert correction.rollout_rs == option and said(plan, "verl 0.7.0", option)
    (rule,) = correction.params().rejection
    # one token a sequence: every level sees the token's ratio
    ratios = torch.tensor([[0.7, 0.85, 1.4, 1.6]])
    kept = [bool(_kept_by(rule, r.log().reshape(1, 1), torch.ones(1, 1))) for r in ratios[0]]
    # verl 0.7.0 kept ratios in [0.8, 1.5]
    assert kept == [False, True, True, False]
    cfg, plan = loaded({f"{NEW}rollout_rs": level, f"{NEW}rollout_rs_threshold": 2.0})
    # lower 1/upper: the symmetric band
    assert cfg.algorithm.rollout_correction.rollout_rs_threshold == "2.0"


def test_later_rollout_correction_keys_of_0_6_1_and_0_7_0():
    cfg, plan = loaded({f"{NEW}use_policy_gradient": True, f"{NEW}bypass_mode": True})
    assert cfg.algorithm.rollout_correction.loss_type == "reinforce" and said(
        plan, "use_policy_gradient"
    )
    error = refused({f"{NEW}rollout_token_veto_threshold": 1e-4})
    assert error.code == VERL_UNSUPPORTED and "seq_max_k2" in error.message
    error = refused(
        {
            f"{NEW}rollout_rs": "token_k1",
            f"{NEW}rollout_rs_threshold": "0.5_2.0",
            f"{NEW}rollout_rs_threshold_lower": 0.5,
        }
    )
    assert "rollout_rs_threshold=lower_upper" in error.message
    assert loaded({f"{NEW}rollout_token_veto_threshold": None, f"{NEW}use_policy_gradient": False})


@pytest.mark.parametrize(
    "old, new, value",
    [
        (
            "actor_rollout_ref.rollout.update_weights_bucket_megabytes",
            "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes",
            512,
        ),
        ("ray_init.num_cpus", "ray_kwargs.ray_init.num_cpus", 4),
        ("trainer.profile_steps", "global_profiler.steps", [1, 2]),
        (
            "trainer.worker_nsight_options.trace",
            "global_profiler.global_tool_config.nsys.worker_nsight_options.trace",
            "cuda",
        ),
    ],
)
def test_a_renamed_key_is_taken_under_its_new_name(old, new, value):
    # accepted as its new name is; never the unknown-key error
    assert loaded({old: value})


def test_verl_0_9s_reward_section_is_read_under_the_names_keel_reads():
    cfg, plan = loaded(
        {
            "reward.custom_reward_function.path": "my_reward.py",
            "reward.custom_reward_function.name": "f",
            "reward.reward_model.enable": False,
            "reward.reward_manager.name": "batch",
        }
    )
    assert (
        cfg.custom_reward_function.path == "my_reward.py" and cfg.custom_reward_function.name == "f"
    )
    # verl's batch reward manager
    assert cfg.custom_reward_function.batched
    assert said(plan, "reward.custom_reward_function.path: is custom_reward_function.path")
    # the old name wins where it is set, as verl 0.9.1's migrate_legacy_reward_impl does
    cfg, plan = loaded(
        {"custom_reward_function.path": "old.py", "reward.custom_reward_function.path": "new.py"}
    )
    assert cfg.custom_reward_function.path == "old.py"
    cfg, plan = loaded(
        {"custom_reward_function.path": None, "reward.custom_reward_function.path": "new.py"}
    )
    assert cfg.custom_reward_function.path == "new.py"
    error = refused({"reward.sandbox_fusion.url": "http://sandbox"})
    assert error.code == VERL_UNSUPPORTED and "reward_model.sandbox_fusion.url" in error.message


def test_verl_0_9_1s_whole_trainer_config_loads():
    tree = yaml.safe_load((KEEL_COPY / "ppo_trainer.yaml").read_text())
    cfg = load_config(tree, SMALL)
    # 0.9.1's "reward": the score before KL
    assert cfg.algorithm.filter_groups.metric == "seq_reward"
    leaves = []

    def walk(node, prefix=""):
        for key, value in node.items():
            walk(value, f"{prefix}{key}.") if isinstance(value, dict) and value else leaves.append(
                (prefix + key, value)
            )

    walk(tree)
    unknown = []
    for key, value in leaves:
        try:
            load_config({}, {**SMALL, key: value})
        except KeelError as error:
            if error.code == UNKNOWN_KEY or "unknown config key" in error.message:
                unknown.append(key)
    assert len(leaves) > 800 and not unknown, unknown


@pytest.mark.parametrize("tracker", ["swanlab", "vemlp_wandb", "clearml", "trackio", "rl_insight"])
def test_verls_other_trackers_are_refused_by_name_with_what_keel_offers(tracker):
    error = refused({"trainer.logger": ["console", tracker]})
    assert error.code == VERL_UNSUPPORTED and repr(tracker) in error.message
    assert all(
        name in error.message for name in ("wandb", "tensorboard", "mlflow", "metrics.jsonl")
    )
    assert error.fix.startswith("set `trainer.logger=[console]`")


def test_verls_tracking_and_file_loggers_are_keels_wandb_and_metrics_file():
    cfg, plan = loaded({"trainer.logger": ["console", "tracking", "file"]})
    assert cfg.trainer.logger == ["console", "wandb"]
    assert said(plan, "tracking is verl's older name of wandb") and said(plan, "metrics.jsonl")
    assert loaded({"trainer.logger": "console"}).config.trainer.logger == ["console"]
