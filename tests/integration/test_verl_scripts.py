"""verl's own example scripts, as their override lists (tests/data/verl_example_overrides.yaml), run
through `keel train` with only paths and sizes changed: two steps on CPU, or a refusal at once that
names each setting keel does not have (KEEL-C015), never a generic error."""

import re
from pathlib import Path

import pytest
import yaml

from keel.api import train
from keel.errors import KeelError

SCRIPTS = yaml.safe_load(
    (Path(__file__).parents[1] / "data" / "verl_example_overrides.yaml").read_text()
)
# What a CPU test cannot run as the script has it: data and models, sizes, devices, how long.
SMALL = {
    "data.train_batch_size": 4,
    "data.max_prompt_length": 48,
    "data.max_response_length": 8,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
    "critic.ppo_mini_batch_size": 2,
    "actor_rollout_ref.rollout.n": 2,
    "trainer.n_gpus_per_node": 1,
    "trainer.nnodes": 1,
    "trainer.total_epochs": 1,
    "trainer.save_freq": -1,
    "trainer.test_freq": -1,
    "trainer.logger": "console",
    "trainer.val_before_train": False,
}
MICRO = re.compile(r".*(micro_batch_size_per_gpu|max_token_len_per_gpu)$")


def shrunk(overrides: list[str], assets: dict, run_dir: Path) -> list[str]:
    paths = {
        "data.train_files": assets["train"],
        "data.val_files": assets["val"],
        "actor_rollout_ref.model.path": assets["model"],
        "critic.model.path": assets["model"],
    }
    out = []
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+")
        if key in paths or key in SMALL:
            continue
        if MICRO.match(key):
            item = f"{key}={2 if 'micro' in key else 512}"
        out.append(item)
    out += [f"{k}={v}" for k, v in {**paths, **SMALL}.items()]
    return out + [
        f"trainer.default_local_dir={run_dir}",
        f"custom_reward_function.path={assets['reward']}",
        "trainer.total_training_steps=2",
    ]


def test_there_are_enough_scripts():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_verl_example_script_trains_or_is_refused_by_name(script, tiny_assets, tmp_path):
    run_dir = tmp_path / "run"
    try:
        result = train(None, shrunk(SCRIPTS[script], tiny_assets, run_dir))
    except KeelError as error:
        codes = set(re.findall(r"KEEL-[A-Z]\d{3}", f"{error.code} {error.message}"))
        assert codes == {"KEEL-C015"}, f"{script}: {error.render()}"
        # refused before any step
        assert not (run_dir / "metrics.jsonl").exists()
        return
    assert result.last_step == 2, script
