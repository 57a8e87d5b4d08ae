"""Rewards scored per sample as samples finish, beside generation: each finished sample's scoring
begins in the reward's worker processes at once (RewardScorer.start), and its batch reads it instead
of scoring it again. Nothing changes but when: the same samples score the same. With partial
rollouts the groups a step does not train yet are scored in the background, and a group that a
failed scoring left short is replaced by another."""

from pathlib import Path

import pytest

from keel.api import train
from keel.rewards.executor import ScoringPool
from keel.rollout.native.batching import ContinuousBatcher
from keel.trainer import partial
from keel.trainer.scored_rollout import ScoredRollout

from test_partial_rollout import metrics_of, run_config

COUNTED = '''
import os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Scores vary with the response; prompts whose ground truth is a multiple of 5 cannot be scored
    (but for keel check's probes: the ground truth itself, and an empty answer)."""
    broken = os.environ.get("KEEL_TEST_FAIL_FIVES") and int(ground_truth) % 5 == 0
    if broken and solution_str not in ("", str(ground_truth)):
        raise ValueError("this prompt's scorer is broken")
    return float(len(solution_str) % 3)
'''


@pytest.fixture
def scoring_runs(monkeypatch):
    """Per training batch scored in the pool: how many of its samples had not begun scoring
    ahead."""
    scored_now, real_run = [], ScoringPool.run

    def run(self, tasks, timeout_s, started=None):
        # a training batch's (keel check's probes and validation score in one go)
        if started is not None:
            scored_now.append(sum(s is None for s in started))
        return real_run(self, tasks, timeout_s, started)

    monkeypatch.setattr(ScoringPool, "run", run)
    return scored_now


def scored_config(
    tiny_config, tmp_path: Path, name: str, model: Path, ahead: bool = True, **trainer
) -> dict:
    reward = tmp_path / "counted.py"
    reward.write_text(COUNTED)
    config = run_config(tiny_config, tmp_path, name, model, **trainer)
    config["custom_reward_function"] = {"path": str(reward)}
    config["reward"] = {"num_workers": 2, "max_not_scored_ratio": 1.0, "score_ahead": ahead}
    return config


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_samples_begin_scoring_as_they_finish_and_score_as_a_batch_would(
    tiny_config, tmp_path, ending_model, monkeypatch, scoring_runs, mode
):
    """The first sample of each batch begins scoring while the batcher still decodes the rest; none
    is scored twice; and the run's scores and losses equal a run that scores each batch whole
    (score_ahead=false)."""
    decode_steps, first_starts, real_step = [0], {}, ContinuousBatcher.step

    def counted_step(self, params, look_every=None):
        decode_steps[0] += 1
        return real_step(self, params, look_every)

    real_start = ScoredRollout.start_scoring

    def start_scoring(self, record, text):
        first_starts.setdefault(self.components.sampler.state_dict()["position"], decode_steps[0])
        return real_start(self, record, text)

    real_generate = ScoredRollout.generate
    decode_ends = []

    def generate(self, timer, seed):
        generated = real_generate(self, timer, seed)
        decode_ends.append(decode_steps[0])
        return generated

    monkeypatch.setattr(ContinuousBatcher, "step", counted_step)
    monkeypatch.setattr(ScoredRollout, "start_scoring", start_scoring)
    monkeypatch.setattr(ScoredRollout, "generate", generate)
    settings = {"mode": mode, "partial_rollout": False, "max_off_policy_steps": 1}
    ahead = metrics_of(
        train(scored_config(tiny_config, tmp_path, "ahead", ending_model, **settings)).run_dir
    )
    # every sample's scoring had begun as it finished
    assert scoring_runs and not any(scoring_runs)
    assert len(first_starts) == len(decode_ends)
    assert all(start < end for start, end in zip(first_starts.values(), decode_ends))
    scoring_runs.clear()
    whole = metrics_of(
        train(
            scored_config(tiny_config, tmp_path, "whole", ending_model, False, **settings)
        ).run_dir
    )
    # score_ahead=false: every batch scored after its generation
    assert scoring_runs and all(scoring_runs)
    for key in ("critic/score/mean", "actor/pg_loss", "response_length/mean"):
        assert [m[key] for m in ahead] == [m[key] for m in whole], key


def test_partial_rollouts_score_the_groups_that_wait_in_the_background(
    tiny_config, tmp_path, ending_model, monkeypatch, scoring_runs
):
    """Bound 2: younger batches finish in a step's round and train a step or two later. Their
    samples began scoring in the round they finished, so some trained samples were scored before
    their step, and no trained sample is scored again when it trains."""
    step_now, began, trained_at = [0], {}, []
    real_call, real_start, real_round = (
        partial.RolloutPartial.__call__,
        ScoredRollout.start_scoring,
        None,
    )

    def call(self, timer, step):
        step_now[0] = step
        return real_call(self, timer, step)

    def start_scoring(self, record, text):
        began.setdefault((record.index, text), step_now[0])
        return real_start(self, record, text)

    real_round = partial.RolloutPartial._round

    def round_noted(self, timer, seed, updates, wanted):
        generated = real_round(self, timer, seed, updates, wanted)
        batch = generated.batch
        trained_at.extend(
            ((r.index, text), step_now[0]) for r, text in zip(batch.records, batch.response_texts)
        )
        return generated

    monkeypatch.setattr(partial.RolloutPartial, "__call__", call)
    monkeypatch.setattr(partial.RolloutPartial, "_round", round_noted)
    monkeypatch.setattr(ScoredRollout, "start_scoring", start_scoring)
    config = scored_config(
        tiny_config, tmp_path, "pool", ending_model, steps=6, max_off_policy_steps=2
    )
    train(config)
    assert scoring_runs and not any(scoring_runs)
    assert all(began[sample] <= step for sample, step in trained_at)
    # scored while earlier steps trained
    assert any(began[sample] < step for sample, step in trained_at)


def test_partial_rollouts_replace_a_group_that_a_failed_scoring_left_short(
    tiny_config, tmp_path, ending_model, monkeypatch
):
    """reward.on_error=mask: a prompt whose scorer raises loses its samples. With partial rollouts
    another round's group takes its place: every step trains train_batch_size whole groups, none of
    them broken."""
    monkeypatch.setenv("KEEL_TEST_FAIL_FIVES", "1")
    config = scored_config(tiny_config, tmp_path, "refill", ending_model, steps=6)
    batches = []
    real_call = partial.RolloutPartial.__call__

    def call(self, timer, step):
        samples = real_call(self, timer, step)
        batches.append(samples.batch)
        return samples

    monkeypatch.setattr(partial.RolloutPartial, "__call__", call)
    metrics = metrics_of(train(config).run_dir)
    n, groups = config["actor_rollout_ref"]["rollout"]["n"], config["data"]["train_batch_size"]
    for batch in batches:
        assert len(batch) == n * groups and len(set(batch.group_index.tolist())) == groups
        assert all(
            int(r.ground_truth) % 5 or text == ""
            for r, text in zip(batch.records, batch.response_texts)
        )
    assert any(m["reward/not_scored_ratio"] > 0 for m in metrics)
    assert any(m["async/refill/gen_batches"] > 1 for m in metrics)


@pytest.mark.parametrize("ahead", [True, False])
def test_multi_turn_episodes_begin_scoring_as_each_ends(tiny_config, tmp_path, ahead):
    """keel's agent loop on the native engine tells each episode as it ends, with the record the
    batch gives its row (num_turns and the rest of extra_info, which the reward reads): every
    episode began scoring before its batch was done, and scored as the batch would score it."""
    from test_multi_turn import REWARD, multi_turn_config

    config = multi_turn_config(tiny_config, tmp_path)
    reward = tmp_path / "turns.py"
    reward.write_text(REWARD)
    config["custom_reward_function"] = {"path": str(reward)}
    config["reward"] = {"num_workers": 2, "score_ahead": ahead}
    config["actor_rollout_ref"]["rollout"]["name"] = "native"
    config["actor_rollout_ref"]["rollout"]["multi_turn"]["max_tokens_per_turn"] = 16
    config["trainer"]["default_local_dir"] = str(tmp_path / f"ahead_{ahead}")
    steps = metrics_of(train(config).run_dir)
    assert [m["reward/scored_ahead"] for m in steps] == [float(ahead)] * 2
    # 0.01 x num_turns at least: the record was read
    assert all(m["critic/score/mean"] > 0 for m in steps)


def test_episodes_whose_row_an_environment_completes_score_with_their_batch(tiny_config, tmp_path):
    """An interaction (an environment) adds its scores to each row as the batch closes it: those
    episodes cannot be scored before, and are not."""
    from test_multi_turn import interaction_config

    config = interaction_config(tiny_config, tmp_path)
    config["reward"] = {"num_workers": 2}
    config["actor_rollout_ref"]["rollout"]["name"] = "native"
    steps = metrics_of(train(config).run_dir)
    assert [m["reward/scored_ahead"] for m in steps] == [0.0] * 2
