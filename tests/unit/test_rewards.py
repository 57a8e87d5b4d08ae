"""Built-in scorers, custom reward functions and refusing bad rewards."""

from types import SimpleNamespace

import pytest

from keel.errors import (
    MISSING_GROUND_TRUTH,
    NO_SCORER,
    REWARD_FN_LOAD,
    REWARD_NOT_NUMBER,
    KeelError,
)
from keel.rewards.custom_fn import load_custom_reward_fn
from keel.rewards.reward_fn import RewardScorer
from keel.rewards.scorers import arithmetic, exact_match, gsm8k


def record(data_source="gsm8k", ground_truth="72"):
    return SimpleNamespace(data_source=data_source, ground_truth=ground_truth, extra_info={})


@pytest.mark.parametrize(
    "response, expected",
    [
        ("She sold 48 + 24 = 72 clips.\n#### 72", 1.0),
        # the last answer counts
        ("#### 1,000 then #### 72", 1.0),
        ("#### 71", 0.0),
        # strict: no #### marker
        ("The answer is 72", 0.0),
        ("", 0.0),
    ],
)
def test_gsm8k(response, expected):
    assert gsm8k("openai/gsm8k", response, "72") == expected


def test_gsm8k_strips_thousands_separators():
    assert gsm8k("openai/gsm8k", "#### 1,234", "1234") == 1.0


@pytest.mark.parametrize(
    "response, truth, expected",
    [(" Paris\n", "Paris", 1.0), ("paris", "Paris", 0.0), ("7", 7, 1.0)],
)
def test_exact_match(response, truth, expected):
    assert exact_match("x", response, truth) == expected


def test_dispatch_by_data_source_and_unknown_source_is_an_error():
    scorer = RewardScorer()
    scores = scorer.score([record("openai/gsm8k"), record("exact_match", "hi")], ["#### 72", "hi"])
    assert scores.tolist() == [1.0, 1.0]
    with pytest.raises(KeelError) as info:
        scorer.check_records([record("my_task")])
    assert info.value.code == NO_SCORER and "my_task" in info.value.message


def test_rows_without_ground_truth_are_refused_for_built_in_scorers():
    rows = [SimpleNamespace(data_source="openai/gsm8k", ground_truth=None, extra_info={}, index=7)]
    with pytest.raises(KeelError) as info:
        RewardScorer().check_records(rows)
    assert info.value.code == MISSING_GROUND_TRUTH and "row 7" in info.value.message
    # a custom scorer may not need one
    RewardScorer(lambda *a: 1.0).check_records(rows)


@pytest.mark.parametrize(
    "response, expected",
    [("57", 1.0), (" 57\n", 1.0), ("57.0", 0.0), ("--57", 0.0), ("5 7", 0.0), ("", 0.0)],
)
def test_arithmetic_scorer(response, expected):
    assert arithmetic("keel/arithmetic", response, "57") == expected


def test_numpy_and_tensor_rewards_are_numbers():
    import numpy as np
    import torch

    for value in (np.float32(0.5), np.int64(1), torch.tensor(0.25)):
        assert RewardScorer(lambda *a, v=value: v).score([record()], ["x"]).item() == pytest.approx(
            float(value)
        )


def test_custom_reward_function_from_file(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return {'score': float(solution_str == ground_truth), 'acc': 1}\n"
    )
    scorer = RewardScorer(load_custom_reward_fn(str(path), "score"))
    assert scorer.score([record("anything", "a"), record("other", "a")], ["a", "b"]).tolist() == [
        1.0,
        0.0,
    ]


def test_custom_reward_function_errors(tmp_path):
    with pytest.raises(KeelError) as info:
        load_custom_reward_fn(str(tmp_path / "missing.py"), "f")
    assert info.value.code == REWARD_FN_LOAD
    path = tmp_path / "reward.py"
    path.write_text("def other(*a):\n    return 0.0\n")
    with pytest.raises(KeelError) as info:
        load_custom_reward_fn(str(path), "compute_score")
    assert info.value.code == REWARD_FN_LOAD and "other" in info.value.fix
    path.write_text("import no_such_module_here\n")
    with pytest.raises(KeelError) as info:
        load_custom_reward_fn(str(path), "compute_score")
    assert "ModuleNotFoundError" in info.value.message


@pytest.mark.parametrize("bad", [None, float("nan"), "1.0", float("inf")])
def test_non_number_reward_is_never_a_silent_zero(bad):
    scorer = RewardScorer(lambda *args: bad, max_not_scored_ratio=1.0)
    with pytest.raises(KeelError) as info:
        scorer.score_batch([record()], ["x"], on_error="raise")
    assert info.value.code == REWARD_NOT_NUMBER
    # on_error=mask: not scored, with the reason
    result = scorer.score_batch([record()], ["x"])
    assert not result.scored[0] and result.reasons[0].startswith("not a number")
    assert result.metrics["reward/not_scored/not_a_number"] == 1
