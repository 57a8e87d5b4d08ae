"""Each mistake a user makes in a config, a model directory, a dataset or a scorer: `keel train`
exits with the mistake's code and a fix, without a traceback, and leaves no run directory."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from keel.cli import main


def broken_tokenizer(assets: dict, tmp_path: Path) -> str:
    model = tmp_path / "no_eos_model"
    shutil.copytree(assets["model"], model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["eos_token"] = None
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return str(model)


def small_vocab_model(assets: dict, tmp_path: Path) -> str:
    model = tmp_path / "small_vocab_model"
    shutil.copytree(assets["model"], model)
    config = json.loads((model / "config.json").read_text())
    config["vocab_size"] = 100
    (model / "config.json").write_text(json.dumps(config))
    return str(model)


def truncated_model(assets: dict, tmp_path: Path) -> str:
    """An interrupted download: the weights file cut in half."""
    model = tmp_path / "truncated_model"
    shutil.copytree(assets["model"], model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return str(model)


def resized_model(assets: dict, tmp_path: Path) -> str:
    """config.json from another model size than the weights."""
    model = tmp_path / "resized_model"
    shutil.copytree(assets["model"], model)
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] *= 2
    (model / "config.json").write_text(json.dumps(config))
    return str(model)


def data_file(tmp_path: Path, rows: list[dict]) -> list[str]:
    path = tmp_path / "bad_data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [str(path)]


def reward_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "bad_reward.py"
    path.write_text(body)
    return str(path)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# (code, what the user did: a function of (tiny_assets, tmp_path) returning overrides)
MISTAKES = {
    "KEEL-C001": lambda a, t: ["trainer.save_frequency=2"],
    "KEEL-C002": lambda a, t: ["data.train_batch_size=-4"],
    "KEEL-C003": lambda a, t: ["data.train_batch_size"],
    "KEEL-C004": lambda a, t: ["actor_rollout_ref.actor.ppo_mini_batch_size=3"],
    # GRPO has no critic to warm up
    "KEEL-C006": lambda a, t: ["algorithm.critic_warmup=2"],
    "KEEL-C013": lambda a, t: ["data.max_response_length=1000"],
    "KEEL-M001": lambda a, t: [f"actor_rollout_ref.model.path={t / 'nowhere'}"],
    "KEEL-M002": lambda a, t: [f"actor_rollout_ref.model.path={broken_tokenizer(a, t)}"],
    "KEEL-M004": lambda a, t: [f"actor_rollout_ref.model.path={small_vocab_model(a, t)}"],
    "KEEL-M005": lambda a, t: [f"actor_rollout_ref.model.path={truncated_model(a, t)}"],
    "KEEL-D001": lambda a, t: [f"data.train_files=[{t / 'missing.parquet'}]"],
    "KEEL-D002": lambda a, t: [f"data.train_files={data_file(t, [{'question': 'hi'}] * 8)}"],
    "KEEL-D003": lambda a, t: [f"data.train_files={data_file(t, [{'prompt': 'x' * 200}] * 8)}"],
    "KEEL-D004": lambda a, t: [f"data.train_files={data_file(t, [{'prompt': chat('hi')}] * 2)}"],
    "KEEL-R001": lambda a, t: [
        f"custom_reward_function.path={reward_file(t, 'def other(*a): return 0')}"
    ],
    # data_source 'digits' has no built-in
    "KEEL-R002": lambda a, t: ["custom_reward_function.path=null"],
    "KEEL-R004": lambda a, t: [
        "custom_reward_function.path=null",
        f"data.train_files={data_file(t, [{'prompt': chat('hi'), 'data_source': 'gsm8k'}] * 8)}",
        "data.val_files=[]",
    ],
    "KEEL-R003": lambda a, t: [
        "custom_reward_function.path="
        + reward_file(t, "def compute_score(solution_str, **kw): return str(len(solution_str))")
    ],
    "KEEL-C007": lambda a, t: [f"trainer.resume_mode={t / 'run' / 'global_step_9'}"],
    "KEEL-P004": lambda a, t: ["trainer.nnodes=2"],
    "KEEL-R005": lambda a, t: [
        "custom_reward_function.path="
        + reward_file(t, "def compute_score(solution_str, **kw): return 1 / len(solution_str)")
    ],
}


@pytest.mark.parametrize("code", list(MISTAKES))
def test_mistake_gives_its_code_and_leaves_nothing(
    code, tiny_config, tiny_assets, tmp_path, capsys
):
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(tiny_config))
    run_dir = Path(tiny_config["trainer"]["default_local_dir"])

    overrides = MISTAKES[code](tiny_assets, tmp_path)
    assert main(["train", str(config), *overrides]) == 2

    err = capsys.readouterr().err
    assert f"error[{code}]" in err and "\nfix: " in err and "Traceback" not in err
    assert not run_dir.exists(), f"{code} left {list(run_dir.iterdir())}"

    # keel check says the same: the error and its fix, word for word
    error = err[err.rindex(f"error[{code}]") :].strip()
    assert main(["check", str(config), *overrides]) in (1, 2)
    out = capsys.readouterr()
    checked = "\n".join(line.strip() for line in (out.out + out.err).splitlines())
    assert "\n".join(line.strip() for line in error.splitlines()) in checked


def test_weights_of_another_size_than_the_config_are_named(
    tiny_config, tiny_assets, tmp_path, capsys
):
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(tiny_config))
    assert (
        main(
            [
                "check",
                str(config),
                f"actor_rollout_ref.model.path={resized_model(tiny_assets, tmp_path)}",
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "error[KEEL-M005]" in out and "mlp" in out and "(the config says" in out


def test_missing_config_file(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "error[KEEL-C005]" in capsys.readouterr().err
