"""Shared fixtures: a tiny random model, a prompt dataset and a reward with variance.

Nothing is downloaded: the model and tokenizer are built by keel (keel.models.tiny).
"""

import json
from pathlib import Path

import pytest

import keel  # noqa: F401 - before any test module loads torch: OpenMP's sleeping waits (keel/openmp.py)

REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A deterministic score that differs between almost any two random responses, so every
    estimator (even with one sample per prompt) sees non-zero advantages on any device's RNG."""
    return (sum(map(ord, solution_str)) % 7) / 6
'''


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def digit_rows(n: int, start: int = 0) -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": f"Digits please: {i}"}],
            "data_source": "digits",
            "reward_model": {"ground_truth": str(i)},
            "extra_info": {"index": i},
        }
        for i in range(start, start + n)
    ]


@pytest.fixture(scope="session")
def quickstart_data(tmp_path_factory) -> Path:
    """The quick-start's data and tiny model (its pairs too), written by its own prepare.py."""
    import importlib.util

    script = Path(__file__).parents[1] / "examples" / "quickstart" / "prepare.py"
    spec = importlib.util.spec_from_file_location("prepare", script)
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    out = tmp_path_factory.mktemp("quickstart")
    prepare.main(out)
    return out


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> dict[str, Path]:
    from keel.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("assets")
    return {
        "model": make_tiny_model(root / "model", hidden_size=32, num_layers=2),
        "train": write_jsonl(root / "train.jsonl", digit_rows(32)),
        "val": write_jsonl(root / "val.jsonl", digit_rows(4, start=100)),
        "reward": (root / "reward.py", (root / "reward.py").write_text(REWARD_FILE))[0],
    }


@pytest.fixture(scope="session")
def ending_model(tiny_assets, tmp_path_factory) -> Path:
    """The tiny model, with EOS's (tied) embedding along the direction its last hidden states share,
    so responses end at lengths that differ (a random tiny model almost never samples EOS)."""
    import torch

    from keel.models.load import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(tiny_assets["model"])
    model = load_causal_lm(tiny_assets["model"], torch.device("cpu"))
    ids = tokenizer("Digits please: 1 2 3 4", return_tensors="pt").input_ids
    with torch.no_grad():
        direction = model.model(ids).last_hidden_state[0].mean(0)
        model.get_output_embeddings().weight[tokenizer.eos_token_id] = (
            2.0 * direction / direction.norm()
        )
    out = tmp_path_factory.mktemp("ending") / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture
def tiny_config(tiny_assets, tmp_path) -> dict:
    """A 2-step GRPO config small enough to run in a few seconds on CPU."""
    return {
        "data": {
            "train_files": [str(tiny_assets["train"])],
            "val_files": [str(tiny_assets["val"])],
            "max_prompt_length": 48,
            "max_response_length": 8,
            "train_batch_size": 4,
        },
        "actor_rollout_ref": {
            "model": {"path": str(tiny_assets["model"])},
            "actor": {
                "ppo_mini_batch_size": 2,
                "ppo_micro_batch_size_per_gpu": 4,
                "optim": {"lr": 1e-3, "weight_decay": 0.0},
            },
            "rollout": {"n": 4},
        },
        "algorithm": {"adv_estimator": "grpo"},
        "custom_reward_function": {"path": str(tiny_assets["reward"])},
        "trainer": {
            "total_training_steps": 2,
            "default_local_dir": str(tmp_path / "run"),
            "logger": [],
            "test_freq": 2,
        },
    }


# what ScriptedEngine says it sampled each token with
LOG_PROB = -0.5


class ScriptedEngine:
    """A rollout engine that writes what a test scripts: turn_for(context text, k) is the k-th
    assistant turn of the conversation whose context it is given (k counted from the assistant
    generation prompts in it). For agent-loop tests: the turns a trained model would write."""

    def __init__(self, tokenizer, turn_for):
        from keel.rollout.base import Capabilities

        self.tokenizer, self.turn_for, self.timing = tokenizer, turn_for, {}
        # generate alone, as the hf engine
        self.capabilities = Capabilities()
        self.eos_ids = [tokenizer.eos_token_id]

    def generate(self, prompts, params):
        import torch

        from keel.rollout.assemble import assemble_batch

        rows = []
        for ids in prompts.input_ids:
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            turn = self.turn_for(text, text.count("<|im_start|>assistant") - 1)
            rows.append(self.tokenizer.encode(turn, add_special_tokens=False) + self.eos_ids)
        width = min(max(map(len, rows)), params.max_new_tokens)
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id)
        for i, row in enumerate(rows):
            ids[i, : min(len(row), width)] = torch.tensor(row[:width])
        return assemble_batch(
            prompts, [(ids, torch.full(ids.shape, LOG_PROB))], self.tokenizer, self.eos_ids, params
        )
