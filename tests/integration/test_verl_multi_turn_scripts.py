"""verl's multi-turn example scripts run through `keel train` with only the program name and the
paths changed, `--config-path/--config-name` included, and sizes shrunk for a CPU (as
test_verl_scripts.py shrinks them): the command is the one the script builds (bash runs the script
with `python3` standing for verl's main_ppo and prints its arguments), its config is verl's example
YAML composing verl's trainer config, its tools verl's gsm8k tool. Two steps on CPU, or a refusal
naming each setting keel does not have (KEEL-C015).

The scripts, their YAML and tool config: tests/data/verl_launch (verl's checkout layout, its working
directory). verl's gsm8k tool class: verl 0.5.0's (tests/data/verl_0_5_0), over the installed
verl."""

import contextlib
import io
import json
import subprocess
from pathlib import Path

import pytest

from test_verl_scripts import MICRO, SMALL

# verl's gsm8k tool class, which verl 0.9.1 no longer ships (tests/data/verl_0_5_0)
try:
    from verl_shim import install_verl_0_5_0_files
except ImportError:
    install_verl_0_5_0_files = None

from keel.cli import main

CHECKOUT = Path(__file__).parents[1] / "data" / "verl_launch"
SCRIPTS = CHECKOUT / "examples" / "sglang_multiturn"
# Each script, and the settings keel refuses in it by name (nothing else may be refused).
REFUSED = {
    "run_qwen2.5-3b_gsm8k_multiturn.sh": {"actor_rollout_ref.rollout.over_sample_rate"},
    "run_qwen2.5-3b_gsm8k_multiturn_vllm_fsdp.sh": set(),
}
CPU = {
    **SMALL,
    "trainer.device": "cpu",
    "data.max_response_length": 64,
    "data.max_prompt_length": 160,
    "actor_rollout_ref.rollout.n": 2,
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 2,
}
# the script's python3 -m verl.trainer.main_ppo, its arguments
ECHO = 'python3() { printf "%s\\0" "$@"; }\n'


def script_argv(script: Path, home: Path) -> list[str]:
    """The arguments the script passes to verl's main_ppo, as bash builds them (variables,
    quoting)."""
    done = subprocess.run(
        ["bash", "-c", ECHO + 'source "$0"', str(script)],
        cwd=CHECKOUT,
        capture_output=True,
        text=True,
        env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
        timeout=60,
        check=True,
    )
    argv = done.stdout.split("\0")[:-1]
    assert argv[:2] == ["-m", "verl.trainer.main_ppo"], argv[:4]
    return argv[2:]


def gsm8k_rows(n: int, start: int = 0) -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k_multiturn_w_tool.py writes them."""
    rows = []
    for i in range(start, start + n):
        answer = str(3 * i + 4)
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "ability": "math",
                "prompt": [
                    {
                        "role": "system",
                        "content": "You are a math expert. Call calc_gsm8k_reward to check.",
                    },
                    {
                        "role": "user",
                        "content": f"What is {i} times 3 plus 4? Put the answer after ####.",
                    },
                ],
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {
                    "split": "train",
                    "index": i,
                    "need_tools_kwargs": True,
                    "tools_kwargs": {
                        "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": answer}}
                    },
                },
            }
        )
    return rows


def as_keel(argv: list[str], assets: dict, tmp_path: Path) -> list[str]:
    """`keel train` and the script's arguments, its data and model paths changed and its sizes
    shrunk."""
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    for path, rows in ((train, gsm8k_rows(8)), (val, gsm8k_rows(2, start=50))):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    paths = {
        "data.train_files": train,
        "data.val_files": val,
        "actor_rollout_ref.model.path": assets["model"],
    }
    out = []
    for item in argv:
        key = item.split("=", 1)[0].lstrip("+")
        if key in paths or key in CPU:
            continue
        out.append(f"{key}={2 if 'micro' in key else 512}" if MICRO.match(key) else item)
    return [
        "train",
        *out,
        *(f"{k}={v}" for k, v in {**paths, **CPU}.items()),
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "trainer.total_training_steps=2",
    ]


def test_the_scripts_name_their_config_as_verls_main_ppo_reads_it(tmp_path):
    argv = script_argv(SCRIPTS / "run_qwen2.5-3b_gsm8k_multiturn.sh", tmp_path)
    assert (
        f"--config-path={SCRIPTS / 'config'}" in argv
        and "--config-name=gsm8k_multiturn_grpo" in argv
    )
    assert f"data.train_files={tmp_path}/data/gsm8k/train.parquet" in argv


@pytest.mark.parametrize("script", sorted(REFUSED))
def test_a_verl_multi_turn_script_trains_through_keel_train(
    script, tiny_assets, tmp_path, monkeypatch
):
    if install_verl_0_5_0_files is None:
        pytest.skip(
            "verl 0.5.0's gsm8k tool (tests/data/verl_0_5_0, "
            "verl_shim.install_verl_0_5_0_files) is absent"
        )
    # verl importable: its gsm8k tool runs unchanged
    install_verl_0_5_0_files()
    # not verl's checkout: its YAML's hydra.searchpath is not here
    monkeypatch.chdir(tmp_path)
    argv = as_keel(script_argv(SCRIPTS / script, tmp_path), tiny_assets, tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = main(argv)
    output = out.getvalue()
    if REFUSED[script]:
        assert status == 2 and "KEEL-C001" not in output, output[-3000:]
        refused = {
            line.split("]: ")[1].split("=")[0]
            for line in output.splitlines()
            if "error[KEEL-" in line and "problems in the config" not in line
        }
        assert refused == REFUSED[script], output[-3000:]
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
        return
    assert status == 0, output[-4000:]
    steps = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(steps) == 2, output[-3000:]
    check = (tmp_path / "run" / "check.txt").read_text()
    # where it came from; verl's tool
    assert "verl's trainer config" in check and "calc_gsm8k_reward" in check
