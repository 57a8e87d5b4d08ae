"""rollout.agent.on_prefix_break=segments: a sample whose agent rewrote its history trains each
continuous stretch as a sequence of its own, only on the tokens the engine sampled in it; the sample
is scored once (on its final segment), counts once in its group, and every segment takes its
advantage; the update keeps the number of mini-batches its samples make."""

import dataclasses
from concurrent.futures import Future

import torch

from keel.algorithms.advantages import AdvantageInputs, AdvantageParams, compute_advantage
from keel.data.prompts import collate_prompts
from keel.models.load import load_tokenizer
from keel.rewards.reward_fn import ScoreResult
from keel.rollout.agent.external.agents import Outcome
from keel.rollout.agent.external.rollout import traces_batch
from keel.rollout.agent.external.trace import Trace
from keel.trainer.roles import _rows_per_mini_batch
from keel.trainer.scored_rollout import score_samples
from keel.types import PromptRecord


def two_samples(tokenizer, segments: bool):
    """Sample 0 continues its history; sample 1 rewrites it before its second turn."""
    records = [
        PromptRecord(7, [5, 6, 7], "p", "src", None),
        PromptRecord(7, [5, 6, 7], "p", "src", None),
    ]
    prompts = collate_prompts(records, tokenizer.pad_token_id)
    kept, rewritten = Trace(), Trace()
    kept.record([5, 6, 7], [20, 21], [-0.1, -0.2], stopped=True)
    kept.record([5, 6, 7, 20, 21, 30], [22], [-0.3], stopped=True)
    rewritten.record([5, 6, 7], [40, 41], [-0.4, -0.5], stopped=True)
    # its first prompt changed
    rewritten.record([5, 9, 7, 40, 41, 30], [42, 43], [-0.6, -0.7], stopped=True)
    outcomes = [Outcome(reward=1.0), Outcome(reward=0.0)]
    return traces_batch(prompts, [kept, rewritten], outcomes, tokenizer, segments=segments)


def trained(batch, row: int) -> list[int]:
    return batch.response_ids[row][batch.response_mask[row].bool()].tolist()


def test_a_rewritten_history_trains_as_segments_of_sampled_tokens_only(tiny_assets):
    tokenizer = load_tokenizer(tiny_assets["model"])
    batch = two_samples(tokenizer, segments=True)
    assert len(batch) == 3 and batch.sample_index.tolist() == [0, 1, 1]
    assert [trained(batch, row) for row in range(3)] == [[20, 21, 22], [40, 41], [42, 43]]
    assert batch.sampling_log_probs[2][:2].tolist() == torch.tensor([-0.6, -0.7]).tolist()
    prompts = [batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist() for row in range(3)]
    # each segment after its own context
    assert prompts == [[5, 6, 7], [5, 6, 7], [5, 9, 7, 40, 41, 30]]
    assert [r.extra_info.get("agent_segment") for r in batch.records] == [None, 0, 1]
    assert not any("agent_dropped" in r.extra_info for r in batch.records)
    assert batch.final_segments.tolist() == [0, 2, 2] and batch.group_index.tolist() == [7, 7, 7]


def test_without_segments_the_rewritten_sample_is_dropped(tiny_assets):
    batch = two_samples(load_tokenizer(tiny_assets["model"]), segments=False)
    assert len(batch) == 2 and batch.sample_index is None
    assert (
        batch.records[1].extra_info["agent_dropped"] == "prefix_break" and trained(batch, 1) == []
    )


class CountingReward:
    """Scores a response by its text's length, recording what it was asked."""

    def __init__(self):
        self.asked: list[str] = []

    def score_batch(self, records, texts, lengths=None):
        self.asked += texts
        scores = torch.tensor([float(len(t)) for t in texts])
        extras = [{"text": t} for t in texts]
        return ScoreResult(
            scores, torch.ones(len(texts), dtype=torch.bool), [None] * len(texts), {}, extras
        )


def test_a_sample_is_scored_once_on_its_final_segment(tiny_assets):
    batch = two_samples(load_tokenizer(tiny_assets["model"]), segments=True)
    batch = dataclasses.replace(
        batch, response_texts=["first sample", "an earlier turn", "the last answer"]
    )
    reward = CountingReward()
    scored = score_samples(reward, batch)
    assert reward.asked == ["first sample", "the last answer"]
    assert scored.scores.tolist() == [12.0, 15.0, 15.0]
    assert [e["text"] for e in scored.extras] == [
        "first sample",
        "the last answer",
        "the last answer",
    ]


def outcome_inputs(scores: list[float], mask: torch.Tensor, groups: list[int]) -> AdvantageInputs:
    rewards = torch.zeros_like(mask)
    last = (mask * torch.arange(mask.shape[1])).argmax(-1)
    rewards[torch.arange(len(scores)), last] = torch.tensor(scores)
    return AdvantageInputs(rewards, mask, torch.tensor(groups))


def test_a_sample_counts_once_in_its_group_and_its_segments_share_its_advantage():
    # group 0: sample A in two segments (rows 0, 1), B; group 1: C, D
    mask = torch.tensor(
        [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.float32
    )
    segmented = outcome_inputs([0.5, 0.5, 0.0, 2.0, 0.0], mask, [0, 0, 0, 1, 1])
    # A as its final segment alone
    samples = [1, 2, 3, 4]
    whole = outcome_inputs([0.5, 0.0, 2.0, 0.0], mask[samples], [0, 0, 1, 1])
    for name in ("grpo", "rloo"):
        advantages, _ = compute_advantage(
            name, segmented, AdvantageParams(), torch.tensor([1, 1, 2, 3, 4])
        )
        expected, _ = compute_advantage(name, whole, AdvantageParams())
        assert torch.allclose(advantages[samples], expected)
        # A's first segment: A's advantage
        assert torch.allclose(advantages[0], expected[0, 0] * mask[0])
        counted_twice, _ = compute_advantage(name, segmented, AdvantageParams())
        # what the rows alone would give
        assert not torch.allclose(counted_twice[samples], expected)


def test_segments_keep_the_updates_number_of_mini_batches(tiny_assets):
    batch = two_samples(load_tokenizer(tiny_assets["model"]), segments=True)
    # 2 samples in 3 rows, a sample a mini-batch: 2 of 2 and 1
    assert _rows_per_mini_batch(batch, 1) == 2
    assert (
        _rows_per_mini_batch(two_samples(load_tokenizer(tiny_assets["model"]), segments=False), 1)
        == 1
    )


class Results(list):
    memory = [{"rss_gb": 0.1}, {"rss_gb": 0.1}]


class TwoRanks:
    """A worker group of two ranks whose rollouts each number their samples from 0."""

    world_size = 2

    def __init__(self, batch):
        self.batch = batch

    def call(self, method, per_rank_args):
        return Results(
            [(self.batch.select(range(len(self.batch))), {"gen": 1.0}) for _ in per_rank_args]
        )

    def submit(self, method, per_rank_args):
        done = Future()
        done.set_result(self.call(method, per_rank_args))
        return done


def test_samples_of_different_ranks_stay_different_samples(tiny_assets):
    from keel.trainer.roles import UpdateSchedule, WorkerRoles
    from keel.types import SamplingParams

    tokenizer = load_tokenizer(tiny_assets["model"])
    # samples 0 and 1 in rows [0, 1, 1]
    one_rank = two_samples(tokenizer, segments=True)
    roles = WorkerRoles(TwoRanks(one_rank), tokenizer.pad_token_id, UpdateSchedule(2, 1, False, 8))
    prompts = collate_prompts(
        [PromptRecord(i, [5, 6, 7], "p", "src", None) for i in range(4)], tokenizer.pad_token_id
    )
    batch, _ = roles.generation.generate(prompts, SamplingParams(), seed=0)
    # the second rank's prompts start at 2
    assert batch.sample_index.tolist() == [0, 1, 1, 2, 3, 3]
    assert batch.final_segments.tolist() == [0, 2, 2, 3, 5, 5]
