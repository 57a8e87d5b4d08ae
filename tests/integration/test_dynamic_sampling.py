"""DAPO's dynamic sampling (algorithm.filter_groups): prompts whose samples all scored alike leave
the batch and more are generated until data.train_batch_size prompts remain, counted and capped."""

import json

import pytest
import torch

from keel.algorithms.groups import groups_with_signal
from keel.api import train
from keel.errors import FILTER_GROUPS_EXHAUSTED, KeelError

# Even rows score 1 whatever is written (no signal); odd rows score by the response (a signal).
HALF_FLAT = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    if extra_info['index'] % 2 == 0:\n"
    "        return {'score': 1.0, 'acc': 1.0}\n"
    "    value = (sum(map(ord, solution_str)) % 7) / 6\n"
    "    return {'score': value, 'acc': float(value > 0.5)}\n"
)


def test_groups_whose_samples_scored_alike_are_found():
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    # a lone sample has no signal either
    groups = torch.tensor([7, 7, 3, 3, 9, 9, 4])
    assert groups_with_signal(values, groups).tolist() == [
        False,
        False,
        True,
        True,
        False,
        False,
        False,
    ]


def filtered_run(tiny_config, tmp_path, source, **filter_groups):
    reward = tmp_path / "reward.py"
    reward.write_text(source)
    tiny_config["custom_reward_function"]["path"] = str(reward)
    tiny_config["algorithm"]["filter_groups"] = {"enable": True, "metric": "score", **filter_groups}
    tiny_config["trainer"].update({"test_freq": -1, "val_before_train": False, "log_samples": 100})
    return train(tiny_config)


def test_only_prompts_with_a_signal_are_trained_on_and_the_batch_is_full(tiny_config, tmp_path):
    result = filtered_run(tiny_config, tmp_path, HALF_FLAT)
    steps = [
        json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert result.last_step == 2
    # 4 prompts wanted, about half of each generated batch kept
    for step in steps:
        assert step["dynamic_sampling/gen_batches"] >= 2
        assert 0 < step["dynamic_sampling/kept_prompt_ratio"] < 1
        # no flat group reached the update
        assert step["guards/frac_reward_zero_std"] == 0.0
    samples = [
        json.loads(line) for line in (result.run_dir / "samples.jsonl").read_text().splitlines()
    ]
    # digit rows: the index is the answer
    assert samples and all(int(s["ground_truth"]) % 2 == 1 for s in samples)
    # train_batch_size x rollout.n
    assert len([s for s in samples if s["step"] == 1]) == 4 * 4


def test_a_reward_with_no_signal_stops_after_max_num_gen_batches(tiny_config, tmp_path):
    constant = (
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return "
        "1.0\n"
    )
    with pytest.raises(KeelError) as error:
        filtered_run(tiny_config, tmp_path, constant, max_num_gen_batches=3)
    assert (
        error.value.code == FILTER_GROUPS_EXHAUSTED
        and "after 3 generation batches" in error.value.message
    )
