"""GKD with distillation.gkd.lmbda=0.5 on CPU: some steps train on the student's samples, the others
on the data's responses (a `response` column), and the JSD to the teacher falls."""

import copy
import json

import pytest
import torch

from conftest import digit_rows, write_jsonl
from test_train_cli import read_metrics

# every row's response: the data steps then measure the JSD on nearly the same tokens each time
RESPONSE = "1 2 3"


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    from keel.models.tiny import make_tiny_model

    # wider than the student, keel's tokenizer too; confident, as a trained model is
    return make_tiny_model(
        tmp_path_factory.mktemp("teacher") / "model",
        hidden_size=64,
        seed=3,
        initializer_range=0.2,
    )


@pytest.fixture
def gkd_config(tiny_config, teacher, tmp_path) -> dict:
    rows = [{**row, "response": RESPONSE} for row in digit_rows(32)]
    cfg = copy.deepcopy(tiny_config)
    cfg["data"]["train_files"] = [str(write_jsonl(tmp_path / "train.jsonl", rows))]
    cfg["data"]["val_files"] = []
    cfg["actor_rollout_ref"]["actor"]["optim"]["lr"] = 1e-2
    cfg["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] = 4
    cfg["distillation"] = {
        "enable": True,
        "mode": "gkd",
        "teacher": {"path": str(teacher)},
        "gkd": {"lmbda": 0.5, "top_k": 16},
    }
    cfg["trainer"].update(total_training_steps=12, test_freq=0)
    return cfg


def test_half_the_steps_train_on_the_datas_responses_and_the_jsd_falls(gkd_config):
    from keel.api import train

    result = train(gkd_config)
    steps = [m for m in read_metrics(result.run_dir) if m["step"] > 0]
    assert len(steps) == 12
    on_policy = {m["step"]: m["distill/on_policy"] for m in steps}
    assert set(on_policy.values()) == {0.0, 1.0}
    samples = [
        json.loads(line) for line in (result.run_dir / "samples.jsonl").read_text().splitlines()
    ]
    for m in steps:
        responses = {s["response"] for s in samples if s["step"] == m["step"]}
        if on_policy[m["step"]]:
            # the student's samples: the engine's gap measured, the random student's own words
            assert "rollout/log_prob_gap" in m and responses != {RESPONSE}
        else:
            # the data's responses, with no sampler: no gap, the old log-probs from the pass
            assert responses == {RESPONSE}
            assert "rollout/log_prob_gap" not in m and "timing_s/old_log_prob" in m
    data_losses = [m["distill/gkd_loss"] for m in steps if not on_policy[m["step"]]]
    assert data_losses[-1] < 0.7 * data_losses[0]


def test_rollout_correction_weighs_the_students_samples_alone(gkd_config):
    """Decoupled correction (truncated IS weights) on the sampled steps; the data's responses have
    no sampler to weigh them against."""
    from keel.api import train

    gkd_config["algorithm"]["rollout_correction"] = {"rollout_is": "token"}
    gkd_config["trainer"]["total_training_steps"] = 6
    result = train(gkd_config)
    steps = [m for m in read_metrics(result.run_dir) if m["step"] > 0]
    assert {m["distill/on_policy"] for m in steps} == {0.0, 1.0}
    for m in steps:
        corrected = any(key.startswith("rollout_corr/") for key in m)
        assert corrected == bool(m["distill/on_policy"]), m["step"]


def test_a_resumed_run_draws_and_trains_as_an_uninterrupted_one(gkd_config, tmp_path, monkeypatch):
    from keel.api import train
    from keel.trainer import rl

    from test_train_cli import _numerics, weights

    gkd_config["trainer"].update(total_training_steps=6, save_freq=3)
    straight = copy.deepcopy(gkd_config)
    straight["trainer"]["default_local_dir"] = str(tmp_path / "a")
    stopped = copy.deepcopy(gkd_config)
    stopped["trainer"]["default_local_dir"] = str(tmp_path / "b")
    train(straight)
    real_step = rl.RLTrainer.train_step

    def stop_at_step_4(self, logger):
        if self.step == 4:
            raise KeyboardInterrupt
        return real_step(self, logger)

    monkeypatch.setattr(rl.RLTrainer, "train_step", stop_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        train(stopped)
    monkeypatch.setattr(rl.RLTrainer, "train_step", real_step)
    # resumes from global_step_3
    train(stopped)
    metrics_a, metrics_b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [m["step"] for m in metrics_b] == [1, 2, 3, 4, 5, 6]
    # both kinds of step after the resume
    assert {m["distill/on_policy"] for m in metrics_b[3:]} == {0.0, 1.0}
    for ma, mb in zip(metrics_a, metrics_b):
        assert _numerics(ma) == _numerics(mb)
    a, b = (weights(tmp_path / run / "global_step_6" / "actor") for run in ("a", "b"))
    assert all(torch.equal(a[k], b[k]) for k in a)
