"""Every sample is scored or marked not scored with its reason: raising, hanging, dying and
non-number scorers, in this process and in worker processes."""

import threading
import time
from types import SimpleNamespace

import pytest

from keel.errors import SCORER_RAISED, SCORER_TIMEOUT, TOO_MANY_NOT_SCORED, KeelError
from keel.rewards.executor import ScoringEnded
from keel.rewards.reward_fn import RewardScorer


def record(i=0):
    return SimpleNamespace(data_source="task", ground_truth="1", extra_info={}, index=i)


def flaky(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "boom":
        raise ZeroDivisionError("division by zero")
    if solution_str == "hang":
        time.sleep(30)
    return 1.0


def test_failures_are_masked_counted_and_bounded():
    scorer = RewardScorer(flaky, max_not_scored_ratio=0.5, timeout_s=0.5)
    result = scorer.score_batch([record(i) for i in range(4)], ["ok", "boom", "ok", "hang"])
    assert result.scored.tolist() == [True, False, True, False]
    assert (
        result.reasons[1] == "raised ZeroDivisionError: division by zero"
        and result.reasons[3] == "timeout"
    )
    assert result.metrics["reward/not_scored_ratio"] == 0.5
    assert result.metrics["reward/not_scored/raised_ZeroDivisionError"] == 1
    assert result.metrics["reward/not_scored/timeout"] == 1
    # 2 of 4 is over a 0.25 limit
    with pytest.raises(KeelError) as info:
        RewardScorer(flaky, max_not_scored_ratio=0.25, timeout_s=0.5).score_batch(
            [record(i) for i in range(4)], ["ok", "boom", "ok", "hang"]
        )
    assert (
        info.value.code == TOO_MANY_NOT_SCORED and "raised ZeroDivisionError" in info.value.message
    )


def test_zero_and_raise_policies():
    zero = RewardScorer(flaky, on_error="zero", max_not_scored_ratio=1.0)
    result = zero.score_batch([record(), record()], ["ok", "boom"])
    assert result.scores.tolist() == [1.0, 0.0] and result.scored.all()
    # scored 0, still counted
    assert result.metrics["reward/not_scored_ratio"] == 0.5
    with pytest.raises(KeelError) as info:
        RewardScorer(flaky, on_error="raise").score_batch([record()], ["boom"])
    assert info.value.code == SCORER_RAISED
    with pytest.raises(KeelError) as info:
        RewardScorer(flaky, on_error="raise", timeout_s=0.3).score_batch([record()], ["hang"])
    assert info.value.code == SCORER_TIMEOUT


UNTRUSTED = """
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "loop":
        while True:
            pass
    if solution_str == "die":
        os._exit(1)  # the worker process vanishes mid-task
    return float(solution_str == ground_truth)
"""


def test_worker_processes_survive_hangs_and_crashes(tmp_path):
    path = tmp_path / "scorer.py"
    path.write_text(UNTRUSTED)
    scorer = RewardScorer(
        ("file", str(path), "compute_score"), timeout_s=1.0, num_workers=2, max_not_scored_ratio=1.0
    )
    try:
        result = scorer.score_batch([record(i) for i in range(4)], ["1", "loop", "0", "die"])
        assert result.scores[0] == 1.0 and result.scored.tolist() == [True, False, True, False]
        assert result.reasons[1] == "timeout" and result.reasons[3].startswith("timeout")
        # the pool was replaced: the next batch is scored normally
        assert scorer.score_batch([record()], ["1"]).scores.tolist() == [1.0]
    finally:
        scorer.close()


def test_async_scorers_run_concurrently_with_timeouts():
    import asyncio

    in_flight, most = [0], [0]

    async def judge(data_source, solution_str, ground_truth, extra_info):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        await asyncio.sleep(30 if solution_str == "slow" else 0.5)
        in_flight[0] -= 1
        return float(solution_str == ground_truth)

    scorer = RewardScorer(judge, timeout_s=5.0, max_not_scored_ratio=1.0)
    responses = ["1", "0"] * 5 + ["slow"]
    result = scorer.score_batch([record(i) for i in range(11)], responses)
    # all waiting at once, not one after another
    assert most[0] == 11
    assert result.scores.tolist()[:10] == [1.0, 0.0] * 5 and result.reasons[10] == "timeout"


# scorers that catch keel's timeout and return 0 as if they had scored
SWALLOWING = [
    "try:\n        time.sleep(60)\n    except Exception:\n        return 0.0",
    "try:\n        time.sleep(60)\n    except BaseException:\n        return 0.0",
    "for _ in range(3):\n        try:\n            time.sleep(2)\n        except BaseException:\n "
    "           pass\n    return 0.0",
]


@pytest.mark.parametrize("body", SWALLOWING)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_swallowed_timeout_is_still_a_timeout(tmp_path, body, num_workers):
    path = tmp_path / "swallow.py"
    path.write_text(
        f"import time\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        f"    if solution_str != 'hang':\n        return 1.0\n    {body}\n"
    )
    scorer = RewardScorer(
        ("file", str(path), "compute_score"),
        timeout_s=0.5,
        num_workers=num_workers,
        max_not_scored_ratio=1.0,
    )
    try:
        result = scorer.score_batch([record(0), record(1)], ["hang", "ok"])
    finally:
        scorer.close()
    assert result.reasons[0] == "timeout" and not result.scored[0]
    assert result.scored[1] and result.scores[1] == 1.0


def test_off_the_main_thread_the_deadline_answers_without_waiting_for_the_scorer():
    """The reward server scores on its request threads, where no signal reaches: the answer comes
    at the deadline while the scorer is still blocked (it waits for an event set only
    afterwards)."""
    released = threading.Event()

    def stuck(data_source, solution_str, ground_truth, extra_info):
        released.wait()
        return 1.0

    scorer = RewardScorer(stuck, timeout_s=0.5, max_not_scored_ratio=1.0)
    outcome = {}
    thread = threading.Thread(
        target=lambda: outcome.setdefault("r", scorer.score_batch([record()], ["x"]))
    )
    thread.start()
    # a scorer-bound wait would never end: the event is set below
    thread.join(timeout=300)
    released.set()
    assert "r" in outcome and outcome["r"].reasons == ["timeout"]


def test_batched_scorer_scores_the_batch_in_one_call():
    calls = []

    def batch_fn(data_sources, solution_strs, ground_truths, extra_infos):
        calls.append(len(solution_strs))
        return [float(s == g) for s, g in zip(solution_strs, ground_truths)]

    result = RewardScorer(batch_fn, batched=True).score_batch([record(), record()], ["1", "2"])
    assert calls == [2] and result.scores.tolist() == [1.0, 0.0]
    wrong_length = RewardScorer(lambda *lists: [1.0], batched=True, max_not_scored_ratio=1.0)
    result = wrong_length.score_batch([record(), record()], ["1", "2"])
    assert not result.scored.any() and "returned 1 scores for 2 samples" in result.reasons[0]


@pytest.mark.parametrize(
    "per_sample",
    [
        # returns a number
        lambda data_source, solution_str, ground_truth, extra_info=None: 1.0,
        # raises
        lambda data_source, solution_str, ground_truth, extra_info=None: float(
            solution_str.strip() == "1"
        ),
    ],
)
def test_a_per_sample_function_marked_batched_is_told_what_batched_means(per_sample):
    scorer = RewardScorer(per_sample, batched=True, max_not_scored_ratio=1.0)
    result = scorer.score_batch([record(), record()], ["1", "2"])
    assert not result.scored.any() and "once with four lists" in result.reasons[0]


COUNTING = """
import os

def compute_score(data_source, solution_str, ground_truth, extra_info):
    with open(os.path.join(os.path.dirname(__file__), "calls.txt"), "a") as calls:
        calls.write(solution_str + "\\n")
    if solution_str == "boom":
        raise ValueError("no")
    return float(len(solution_str))
"""


def test_scoring_begun_as_samples_finish_is_read_once_and_equals_the_batchs(tmp_path):
    """RewardScorer.start begins a sample's scoring in the worker processes (while the rest
    generate); score_batch(started=...) reads it instead of scoring again, and gives what scoring
    the batch whole gives, failures included. A start of another text is not used: that sample is
    scored again."""
    path = tmp_path / "count.py"
    path.write_text(COUNTING)
    calls = tmp_path / "calls.txt"
    scorer = RewardScorer(
        ("file", str(path), "compute_score"), timeout_s=30, num_workers=2, max_not_scored_ratio=1.0
    )
    texts, records = ["a", "bb", "boom", "dddd"], [record(i) for i in range(4)]
    try:
        whole = scorer.score_batch(records, texts)
        calls.unlink()
        started = [
            scorer.start(records[0], "a"),
            scorer.start(records[1], "bb"),
            None,
            scorer.start(records[3], "old"),
        ]
        streamed = scorer.score_batch(records, texts, started=started)
    finally:
        scorer.close()
    assert streamed.scores.tolist() == whole.scores.tolist() == [1.0, 2.0, 0.0, 4.0]
    assert streamed.scored.tolist() == whole.scored.tolist() == [True, True, False, True]
    assert (
        streamed.reasons == whole.reasons
        and streamed.metrics.keys() - {"reward/scored_ahead"} == whole.metrics.keys()
    )
    # "a" and "bb" of the four
    assert streamed.metrics["reward/scored_ahead"] == 0.5
    # "a" and "bb" once each (begun ahead), "boom" now, "old" ahead but unused and "dddd" scored
    # again
    assert sorted(calls.read_text().split()) == ["a", "bb", "boom", "dddd", "old"]


def test_scoring_begun_in_a_pool_closed_since_is_begun_again(tmp_path):
    path = tmp_path / "count.py"
    path.write_text(COUNTING)
    scorer = RewardScorer(("file", str(path), "compute_score"), timeout_s=30, num_workers=1)
    try:
        started = [scorer.start(record(), "abc")]
        # as after a hung worker: its queue is gone with it
        scorer.close()
        result = scorer.score_batch([record()], ["abc"], started=started)
    finally:
        scorer.close()
    assert result.scores.tolist() == [3.0] and result.scored.all()


def test_only_worker_processes_score_ahead():
    """In this process (num_workers=0) and for batched functions nothing can run beside
    generation."""
    assert RewardScorer(flaky).start(record(), "ok") is None
    assert RewardScorer(flaky, batched=True).start(record(), "ok") is None


def test_the_metrics_of_a_steps_scored_batches_read_as_one_batchs(tmp_path):
    """DAPO and partial rollouts score a step's samples in several batches: their metrics merge into
    what scoring all of them at once reports."""
    from keel.rewards.score_metrics import merge_score_metrics

    scorer = RewardScorer(flaky, max_not_scored_ratio=1.0)
    first, second = ["ok", "boom", "ok"], ["boom", "ok"]
    parts = [(scorer.score_batch([record()] * len(t), t).metrics, len(t)) for t in (first, second)]
    whole = scorer.score_batch([record()] * 5, first + second).metrics
    merged = merge_score_metrics(parts)
    assert merged.keys() == whole.keys()
    assert (
        merged["reward/not_scored_ratio"] == pytest.approx(whole["reward/not_scored_ratio"]) == 0.4
    )
    assert (
        merged["reward/not_scored/raised_ZeroDivisionError"]
        == whole["reward/not_scored/raised_ZeroDivisionError"]
    )
    assert merged["timing_s/score_sample/max"] == max(
        m["timing_s/score_sample/max"] for m, _ in parts
    )


def test_a_sample_begun_ahead_is_read_only_for_its_own_record(tmp_path):
    """What was begun is reused only for the same task: the same text and the same row (ground truth
    and extra_info, numpy arrays as verl's parquet rows hold them included); another row's is scored
    again."""
    import numpy as np

    path = tmp_path / "count.py"
    path.write_text(COUNTING)
    row = SimpleNamespace(
        data_source="task",
        ground_truth=np.array([1, 2]),
        extra_info={"tests": np.arange(3)},
        index=0,
    )
    other = SimpleNamespace(
        data_source="task",
        ground_truth=np.array([1, 3]),
        extra_info={"tests": np.arange(3)},
        index=0,
    )
    scorer = RewardScorer(("file", str(path), "compute_score"), timeout_s=30, num_workers=1)
    try:
        same = scorer.score_batch([row], ["abc"], started=[scorer.start(row, "abc")])
        changed = scorer.score_batch([other], ["abc"], started=[scorer.start(row, "abc")])
    finally:
        scorer.close()
    assert (
        same.metrics["reward/scored_ahead"] == 1.0 and changed.metrics["reward/scored_ahead"] == 0.0
    )
    assert same.scores.tolist() == changed.scores.tolist() == [3.0]


SLEEPING = """
import os
import time

def compute_score(data_source, solution_str, ground_truth, extra_info):
    open(os.path.join(os.path.dirname(__file__), "began"), "w").close()
    time.sleep(600)
    return 1.0
"""


def test_a_batch_in_the_workers_when_the_run_ends_is_dropped_not_waited_out(tmp_path):
    """An async run's last batch is still being scored when the run ends. Shutting the pool down
    ends the wait for it at once with ScoringEnded (no sample counted as not scored), where it used
    to wait out the batch deadline, here an hour: past the join's limit below."""
    path = tmp_path / "sleeping.py"
    path.write_text(SLEEPING)
    scorer = RewardScorer(("file", str(path), "compute_score"), timeout_s=3600, num_workers=1)
    outcome = {}

    def score():
        try:
            outcome["result"] = scorer.score_batch([record()], ["x"])
        except ScoringEnded as ended:
            outcome["ended"] = ended

    thread = threading.Thread(target=score)
    thread.start()
    began = tmp_path / "began"
    for _ in range(1200):  # the worker is scoring: up to 2 minutes for its spawn
        if began.exists():
            break
        time.sleep(0.1)
    scorer.shutdown()
    thread.join(timeout=120)
    assert began.exists() and not thread.is_alive()
    assert "ended" in outcome and "result" not in outcome


def test_a_batch_after_the_run_ended_starts_no_pool(tmp_path):
    path = tmp_path / "count.py"
    path.write_text(COUNTING)
    scorer = RewardScorer(("file", str(path), "compute_score"), timeout_s=30, num_workers=1)
    scorer.shutdown()
    with pytest.raises(ScoringEnded):
        scorer.score_batch([record()], ["abc"])
    assert scorer.pool._pool is None and not (tmp_path / "calls.txt").exists()
