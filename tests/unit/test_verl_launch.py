"""verl's launch form: `keel train --config-path DIR --config-name NAME [overrides]`, the YAML
composed as Hydra composes it (defaults: list, hydra.searchpath), verl's trainer config found from
the installed verl or keel's copy of it; each way it can go wrong is a coded error with a fix."""

from pathlib import Path

import pytest
import yaml

from keel.cli import main
from keel.config import hydra_compose
from keel.config.hydra_compose import KEEL_COPY, VerlLaunch, compose_launch
from keel.config.load import flatten, load_config, load_run
from keel.errors import (
    CONFIG_FILE,
    LAUNCH_CONFIG_NAME,
    LAUNCH_CONFIG_PATH,
    LAUNCH_DEFAULTS,
    LAUNCH_SEARCHPATH,
    KeelError,
)

EXAMPLE = (
    Path(__file__).parents[1] / "data" / "verl_launch" / "examples" / "sglang_multiturn" / "config"
)
REQUIRED = {
    "data.train_files": ["train.parquet"],
    "actor_rollout_ref.model.path": "model",
    "data.train_batch_size": 8,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
    "trainer.n_gpus_per_node": 1,
    "trainer.logger": ["console"],
}


@pytest.fixture
def without_verl(monkeypatch):
    """As on a machine without verl: keel's copy of verl's trainer config is the one found."""
    monkeypatch.setattr(hydra_compose, "installed_verl", lambda: [])


def write(folder: Path, name: str, tree: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(yaml.safe_dump(tree))
    return folder / name


def verl_style(
    folder: Path,
    name: str = "mine.yaml",
    defaults=("ppo_trainer", "_self_"),
    searchpath=("file://verl/trainer/config",),
    **sections,
) -> Path:
    return write(
        folder,
        name,
        {"hydra": {"searchpath": list(searchpath)}, "defaults": list(defaults), **sections},
    )


def error_of(launch, overrides=None) -> KeelError:
    with pytest.raises(KeelError) as info:
        load_config(launch, {**REQUIRED, **(overrides or {})})
    return info.value


def test_verls_example_yaml_composes_verls_trainer_config_from_keels_copy(
    without_verl, tmp_path, monkeypatch
):
    # not a verl checkout: file://verl/trainer/config is not here
    monkeypatch.chdir(tmp_path)
    cfg, plan = load_run(VerlLaunch(str(EXAMPLE), "gsm8k_multiturn_grpo"), REQUIRED)
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    # the example's own values
    assert multi_turn.enable and multi_turn.max_assistant_turns == 5
    assert cfg.data.max_prompt_length == 1024
    # ppo_trainer's
    assert cfg.trainer.total_epochs == 30 and cfg.actor_rollout_ref.actor.clip_ratio_high == 0.2
    # its ${...} references resolved
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"
    # where it came from, said
    assert any("keel's copy of verl 0.9.1's" in line for line in plan.decided)


def test_the_installed_verls_trainer_config_is_the_same_as_keels_copy(tmp_path, monkeypatch):
    if not hydra_compose.installed_verl():
        pytest.skip("verl is not installed (make test installs it)")
    monkeypatch.chdir(tmp_path)
    installed, notes = compose_launch(VerlLaunch(str(EXAMPLE), "gsm8k_multiturn_grpo"))
    assert any("the installed verl" in line for line in notes)
    monkeypatch.setattr(hydra_compose, "installed_verl", lambda: [])
    copy, _ = compose_launch(VerlLaunch(str(EXAMPLE), "gsm8k_multiturn_grpo"))
    # the only key verl's generated file leaves out (it selects files)
    installed.pop("model_engine", None)
    assert flatten(installed) == flatten(copy)


def test_a_verl_checkout_in_the_working_directory_is_hydras_searchpath(tmp_path, monkeypatch):
    checkout = tmp_path / "verl" / "trainer" / "config"
    write(checkout, "ppo_trainer.yaml", {"trainer": {"total_epochs": 3}})
    monkeypatch.chdir(tmp_path)
    tree, _ = compose_launch(VerlLaunch(str(EXAMPLE), "gsm8k_multiturn_grpo"))
    # the checkout's, as verl's script run from its root gets
    assert tree["trainer"] == {"total_epochs": 3}


def test_config_name_alone_and_config_path_config_are_verls_trainer_config(without_verl):
    for launch in (
        VerlLaunch(None, "ppo_trainer"),
        VerlLaunch("config", "ppo_trainer.yaml"),
        VerlLaunch(None, None),
    ):
        cfg, plan = load_run(launch, REQUIRED)
        # verl's default, not keel's
        assert cfg.trainer.total_epochs == 30
        assert any("verl's trainer config" in line for line in plan.decided)


def test_a_yaml_file_with_a_defaults_list_is_composed_too(without_verl, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = verl_style(tmp_path / "conf", trainer={"total_epochs": 2})
    cfg = load_config(str(path), REQUIRED)
    assert cfg.trainer.total_epochs == 2 and cfg.actor_rollout_ref.actor.clip_ratio == 0.2


def test_overrides_apply_after_composing_with_keels_errors(without_verl, tmp_path):
    path = verl_style(tmp_path)
    cfg = load_config(
        VerlLaunch(str(tmp_path), "mine"), {**REQUIRED, "+actor_rollout_ref.actor.clip_ratio": 0.3}
    )
    assert cfg.actor_rollout_ref.actor.clip_ratio == 0.3
    assert (
        error_of(VerlLaunch(str(tmp_path), path.stem), {"trainer.sav_freq": 2}).code == "KEEL-C001"
    )


def test_verls_reward_workers_default_is_not_keels_scoring_processes(without_verl, tmp_path):
    verl_style(tmp_path)
    cfg, plan = load_run(VerlLaunch(str(tmp_path), "mine"), REQUIRED)
    assert cfg.reward.num_workers == 0 and any(
        "reward.num_workers: verl's default 8" in d for d in plan.decided
    )
    verl_style(tmp_path, reward={"num_workers": 2})
    # the YAML's own
    assert load_config(VerlLaunch(str(tmp_path), "mine"), REQUIRED).reward.num_workers == 2
    cfg = load_config(VerlLaunch(str(tmp_path), "mine"), {**REQUIRED, "reward.num_workers": 3})
    # an override's
    assert cfg.reward.num_workers == 3


# --- each coded error
# ------------------------------------------------------------------------------


def test_a_config_path_that_is_not_a_directory(tmp_path):
    verl_style(tmp_path / "config_dir")
    error = error_of(VerlLaunch(str(tmp_path / "config_dri"), "mine"))
    assert error.code == LAUNCH_CONFIG_PATH
    assert error.fix.startswith(
        f"pass `{tmp_path / 'config_dir'}` in place of `{tmp_path / 'config_dri'}`"
    )
    assert (
        error_of(VerlLaunch(str(tmp_path / "config_dir" / "mine.yaml"), "mine")).code
        == LAUNCH_CONFIG_PATH
    )
    assert error_of(VerlLaunch("", "mine")).code == LAUNCH_CONFIG_PATH


def test_a_config_name_the_directory_does_not_hold(tmp_path):
    verl_style(tmp_path, "gsm8k_multiturn_grpo.yaml")
    error = error_of(VerlLaunch(str(tmp_path), "gsm8k_multiturn_gpro"))
    assert error.code == LAUNCH_CONFIG_NAME and "gsm8k_multiturn_grpo" in error.message
    assert error.fix.startswith("pass `gsm8k_multiturn_grpo` in place of `gsm8k_multiturn_gpro`")
    assert error_of(VerlLaunch(str(tmp_path), "")).code == LAUNCH_CONFIG_NAME


def test_a_defaults_list_naming_a_config_not_found(without_verl, tmp_path):
    path = verl_style(tmp_path, defaults=["ppo_trainr", "_self_"])
    error = error_of(VerlLaunch(str(tmp_path), "mine"))
    assert error.code == LAUNCH_DEFAULTS and "'ppo_trainr'" in error.message
    assert error.fix.startswith(f"in `{path}`, write `ppo_trainer` for 'ppo_trainr'")
    verl_style(tmp_path, defaults=[{"ppo_trainer": 3}, "_self_"])
    assert error_of(VerlLaunch(str(tmp_path), "mine")).code == LAUNCH_DEFAULTS


def test_a_searchpath_that_is_not_there(tmp_path):
    verl_style(tmp_path, searchpath=["file://verl/trainer/config", f"file://{tmp_path}/nowhere"])
    error = error_of(VerlLaunch(str(tmp_path), "mine"))
    assert error.code == LAUNCH_SEARCHPATH and "nowhere" in error.message
    verl_style(tmp_path, searchpath=["pkg://no_such_package_of_configs"])
    assert error_of(VerlLaunch(str(tmp_path), "mine")).code == LAUNCH_SEARCHPATH
    write(
        tmp_path,
        "mine.yaml",
        {"hydra": {"searchpath": "file://verl/trainer/config"}, "defaults": ["_self_"]},
    )
    assert error_of(VerlLaunch(str(tmp_path), "mine")).code == LAUNCH_SEARCHPATH


def test_a_primary_yaml_that_does_not_parse(tmp_path):
    (tmp_path / "mine.yaml").write_text("defaults: [ppo_trainer\n")
    assert error_of(VerlLaunch(str(tmp_path), "mine")).code == CONFIG_FILE


def test_the_command_line_gives_coded_errors_never_argparses(tmp_path, capsys):
    verl_style(tmp_path / "conf")
    for argv, code in (
        (["check", "--config-path"], LAUNCH_CONFIG_PATH),
        (
            ["check", "--config-path", str(tmp_path / "cnof"), "--config-name", "mine"],
            LAUNCH_CONFIG_PATH,
        ),
        (["train", "--config-path", str(tmp_path / "conf"), "--config-name"], LAUNCH_CONFIG_NAME),
        (["check", "mine.yaml", "--config-name", "mine"], LAUNCH_CONFIG_PATH),
    ):
        assert main(argv) == 2
        assert f"error[{code}]" in capsys.readouterr().err, argv


def test_overrides_after_an_option_are_overrides(without_verl, tmp_path, capsys):
    verl_style(tmp_path)
    assert (
        main(
            [
                "check",
                "trainer.sav_freq=2",
                "--config-path",
                str(tmp_path),
                "--config-name",
                "mine",
                "trainer.test_fre=3",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    # both read as overrides, both misspelt
    assert "trainer.sav_freq" in err and "trainer.test_fre" in err


def test_keels_copy_is_verls_generated_trainer_config():
    text = (KEEL_COPY / "ppo_trainer.yaml").read_text()
    assert "_generated_ppo_trainer.yaml" in text.splitlines()[
        0
    ] and "defaults" not in yaml.safe_load(text)
