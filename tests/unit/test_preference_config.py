"""Preference-training configs: the option combinations refused with their fix, the objective and
unknown keys named, and `keel check` on the quick-start's DPO and reward-model configs."""

import json
from pathlib import Path

import pytest

from keel.check.findings import PASS, WARN
from keel.check.preference import check_preference
from keel.cli import main
from keel.config.load import load_config, objective_of
from keel.config.preference import PreferenceConfig
from keel.errors import (
    IDENTICAL_PAIR,
    PAIR_TOO_LONG,
    PREFERENCE_OPTION,
    SEPARATE_REFERENCE,
    UNKNOWN_KEY,
    UNKNOWN_OBJECTIVE,
    KeelError,
)

QUICKSTART = Path(__file__).parents[2] / "examples" / "quickstart"
# the smallest config that loads: nothing is read from these paths until training
BASE = {"objective": "dpo", "data": {"train_files": ["pairs.jsonl"]}, "model": {"path": "model"}}


def load(overrides: list[str], source: dict | str | Path = BASE) -> PreferenceConfig:
    return load_config(source, overrides, schema=PreferenceConfig)


def refused(overrides: list[str], source: dict | str | Path = BASE) -> KeelError:
    with pytest.raises(KeelError) as info:
        load(overrides, source)
    return info.value


def first_setting(fix: str) -> str:
    """The first `key=value` a fix line offers."""
    return fix.split("`")[1]


@pytest.mark.parametrize(
    "overrides, said",
    [
        (["dpo.label_smoothing=0.1"], "ignore it"),
        (["dpo.loss_type=robust", "dpo.label_smoothing=0.5"], "at 0.5 or more"),
        (["dpo.loss_type=simpo", "dpo.reference=cached"], "has no reference model"),
        (["dpo.reference=none"], "compares the policy with a reference"),
        (["dpo.reference=adapter"], "model.lora_rank=0"),
        (
            ["dpo.reference=adapter", "model.lora_rank=8", "model.lora_adapter_path=adapter"],
            "model.lora_adapter_path=adapter",
        ),
    ],
    ids=[
        "smoothing-unread-by-sigmoid",
        "smoothing-at-half",
        "simpo-with-reference",
        "sigmoid-without-reference",
        "adapter-without-lora",
        "adapter-after-saved-adapter",
    ],
)
def test_preference_options_that_contradict_are_refused_with_a_fix_that_works(overrides, said):
    error = refused(overrides)
    assert error.code == PREFERENCE_OPTION and said in error.message
    # the fix's first setting makes the config load
    assert isinstance(load(overrides + [first_setting(error.fix)]), PreferenceConfig)


@pytest.mark.parametrize(
    "overrides, reference",
    [
        ([], "cached"),
        (["dpo.loss_type=simpo"], "none"),
        (["dpo.loss_type=robust", "dpo.label_smoothing=0.1"], "cached"),
        (["dpo.reference=adapter", "model.lora_rank=8"], "adapter"),
        (["dpo.loss_type=ipo", "dpo.reference=model"], "model"),
    ],
)
def test_consistent_options_load_and_auto_picks_the_reference(overrides, reference):
    assert load(overrides).reference == reference


def test_a_reward_model_refuses_dpo_options_it_would_not_read():
    assert load(["objective=reward_model"]).objective == "reward_model"
    error = refused(["objective=reward_model", "dpo.label_smoothing=0.1"])
    assert error.code == PREFERENCE_OPTION and "dpo.label_smoothing" in error.message


@pytest.mark.parametrize(
    "source, overrides",
    [
        ({**BASE, "objective": "ppo"}, None),
        (BASE, ["objective=ppo"]),
        (BASE, {"objective": "ppo"}),
        ({}, ["+objective=ppo"]),
    ],
    ids=["file", "override", "override-dict", "added-override"],
)
def test_an_unknown_objective_is_refused(source, overrides):
    with pytest.raises(KeelError) as info:
        objective_of(source, overrides)
    assert info.value.code == UNKNOWN_OBJECTIVE and "'ppo'" in info.value.message
    assert "objective=dpo" in info.value.fix


def test_the_objective_picks_preference_training_and_an_override_wins():
    assert objective_of(BASE) == "dpo"
    assert objective_of(BASE, ["objective=reward_model"]) == "reward_model"
    # an RL config names none
    assert objective_of({"data": {}}) is None


@pytest.mark.parametrize(
    "overrides, suggestion",
    [
        (["dpo.betta=0.2"], "dpo.beta"),
        (["dpo.los_type=ipo"], "dpo.loss_type"),
        # its section left out
        (["simpo_gamma=0.3"], "dpo.simpo_gamma"),
        (["reward_model.center_coeficient=0.1"], "reward_model.center_coefficient"),
    ],
)
def test_an_unknown_key_names_the_closest_key(overrides, suggestion):
    error = refused(overrides)
    assert error.code == UNKNOWN_KEY and f"did you mean {suggestion!r}" in error.message
    assert first_setting(error.fix).startswith(suggestion + "=")


def test_an_unknown_key_in_the_config_file_is_named_too():
    error = refused([], {**BASE, "dpo": {"bta": 0.2}})
    assert error.code == UNKNOWN_KEY and "'dpo.beta'" in error.message


def quickstart_overrides(data: Path, run_dir: Path, train: Path | None = None) -> list[str]:
    return [
        f"data.train_files=[{train or data / 'preference.jsonl'}]",
        f"data.val_files=[{data / 'preference_val.jsonl'}]",
        f"model.path={data / 'model'}",
        f"trainer.default_local_dir={run_dir}",
    ]


@pytest.mark.parametrize("name", ["dpo", "reward_model"])
def test_check_passes_the_quickstart_configs(quickstart_data, tmp_path, name):
    overrides = quickstart_overrides(quickstart_data, tmp_path / "run")
    report = check_preference(load(overrides, QUICKSTART / f"{name}.yaml"))
    assert not report.failures
    assert {f.level for f in report.findings} == {PASS}
    data = [f.message for f in report.findings if f.check == "data"]
    assert data[0].startswith("train preference data: 256 pairs, 0 prompts cut")
    assert data[1].startswith("val preference data: 32 pairs")
    assert report.plan["objective"] == name and report.plan["train pairs"] == 256
    # checking creates nothing
    assert not (tmp_path / "run").exists()


def test_check_warns_that_a_lora_run_needs_no_separate_reference(quickstart_data, tmp_path):
    overrides = quickstart_overrides(quickstart_data, tmp_path / "run")
    cfg = load(overrides + ["model.lora_rank=8", "dpo.reference=model"], QUICKSTART / "dpo.yaml")
    report = check_preference(cfg)
    (finding,) = [f for f in report.findings if f.check == "reference"]
    assert (finding.level, finding.code) == (WARN, SEPARATE_REFERENCE)
    assert "dpo.reference=adapter" in finding.fix
    assert not report.failures


def test_check_reports_identical_and_unreadable_pairs(quickstart_data, tmp_path):
    rows = [{"prompt": "a", "chosen": "same", "rejected": "same"}]
    rows += [{"prompt": "a", "chosen": "b", "rejected": "c"}]
    (tmp_path / "some.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = quickstart_overrides(
        quickstart_data, tmp_path / "run", train=tmp_path / "some.jsonl"
    )
    report = check_preference(load(overrides, QUICKSTART / "dpo.yaml"))
    (train, _) = [f for f in report.findings if f.check == "data"]
    assert (train.level, train.code) == (WARN, IDENTICAL_PAIR) and "1 identical" in train.message
    assert not report.failures
    # a pair over data.max_length with truncation=error fails the check with the data's code
    report = check_preference(
        load(overrides + ["data.max_length=4", "data.truncation=error"], QUICKSTART / "dpo.yaml")
    )
    assert [(f.check, f.code) for f in report.failures] == [("data", PAIR_TOO_LONG)]


def test_keel_check_cli_on_the_quickstart_dpo_config(quickstart_data, tmp_path, capsys):
    overrides = quickstart_overrides(quickstart_data, tmp_path / "run")
    assert main(["check", str(QUICKSTART / "dpo.yaml"), *overrides]) == 0
    out = capsys.readouterr().out
    assert "256" in out and "sigmoid" in out
    # a refused option is the CLI's error, not a crash
    assert main(["check", str(QUICKSTART / "dpo.yaml"), *overrides, "dpo.reference=none"]) != 0
