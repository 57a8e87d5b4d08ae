"""The step's TrainBatch with a teacher: TrainBatchBuilder.train_batch over stand-in workers (the
teacher's scores are given), with a real config. reverse_kl adds coef x (teacher - student) to the
task's advantages weighted by task_reward_coef; gkd keeps the task's alone and carries the
teacher's top-k to the update; distill/* and timing_s/teacher are recorded."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from keel.config.load import load_run
from keel.observe.metrics import Timer
from keel.trainer.train_batch import OldLogProbs, StepState, TrainBatchBuilder
from keel.training.teacher import TeacherScores
from keel.types import SamplingParams, ScoredBatch

from tests_helpers import make_batch

COEF, TASK_COEF = 0.5, 0.25


class Workers:
    """The worker roles the builder calls with a teacher and nothing else (no reference, no
    critic): the teacher's scores are given."""

    def __init__(self, scores: TeacherScores):
        self.scores, self.scored = scores, []

    def teacher_scores(self, batch: ScoredBatch) -> TeacherScores:
        self.scored.append(len(batch))
        return self.scores


def builder(tmp_path, mode: str, scores: TeacherScores) -> TrainBatchBuilder:
    from keel.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "model", hidden_size=16, num_layers=1)
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "a", "answer": "1"}\n')
    run = load_run(
        {
            "data": {
                "train_files": [str(train)],
                "max_prompt_length": 8,
                "max_response_length": 4,
                "train_batch_size": 2,
            },
            "actor_rollout_ref": {
                "model": {"path": str(model)},
                "rollout": {"n": 2},
                "actor": {"ppo_mini_batch_size": 2},
            },
            "algorithm": {"adv_estimator": "grpo"},
            "distillation": {
                "enable": True,
                "mode": mode,
                "teacher": {"path": str(model)},
                "coef": COEF,
                "task_reward_coef": TASK_COEF,
            },
            "trainer": {"total_training_steps": 1, "logger": []},
        }
    )
    components = SimpleNamespace(
        plan=run.plan, workers=Workers(scores), normalizer=None, kl_ctrl=None
    )
    return TrainBatchBuilder(run.config, components, SamplingParams(n=2))


def scored_batch() -> ScoredBatch:
    """Two groups of two: scores 1 and 0 (GRPO: +-1/sqrt(2)), 0.5 and 0.5 (0)."""
    batch = make_batch([4, 2, 3, 1], width=4)
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(ScoredBatch)}
    generator = torch.Generator().manual_seed(0)
    fields.update(
        group_index=torch.tensor([0, 0, 1, 1]),
        scores=torch.tensor([1.0, 0.0, 0.5, 0.5]),
        sampling_log_probs=-torch.rand(4, 4, generator=generator) * batch.response_mask,
    )
    return ScoredBatch(**fields)


def teacher_scores(scored: ScoredBatch, k: int | None) -> TeacherScores:
    generator = torch.Generator().manual_seed(1)
    mask = scored.response_mask
    log_probs = -2 * torch.rand(mask.shape, generator=generator) * mask
    if k is None:
        return TeacherScores(log_probs)
    top_ids = torch.randint(0, 50, (*mask.shape, k), generator=generator)
    top_log_probs = -torch.rand(*mask.shape, k, generator=generator) * mask[..., None]
    return TeacherScores(log_probs, top_ids, top_log_probs)


def step_state() -> StepState:
    return StepState(step=1, updating=0, updates_actor=True, timer=Timer(), metrics={})


def task_advantages(scored: ScoredBatch) -> torch.Tensor:
    """GRPO by hand: (score - group mean) / (unbiased group std + 1e-6) on every real token."""
    per_sample = torch.tensor([2**-0.5, -(2**-0.5), 0.0, 0.0]) / (1 + 1e-6 * 2**0.5)
    return per_sample[:, None] * scored.response_mask


@pytest.mark.parametrize("pass_ran", [False, True])
def test_reverse_kl_adds_the_teachers_judgement_to_the_weighted_task_advantage(tmp_path, pass_ran):
    scored = scored_batch()
    teacher = teacher_scores(scored, k=None)
    build = builder(tmp_path, "reverse_kl", teacher)
    # on-policy the student is the sampler; after the old-log-prob pass, that pass
    recomputed = scored.sampling_log_probs - 0.3 * scored.response_mask
    old = OldLogProbs(
        values=recomputed if pass_ran else None, own=None, measured_in_update=not pass_ran
    )
    student = recomputed if pass_ran else scored.sampling_log_probs
    at = step_state()
    batch = build.train_batch(scored, old, at)
    mask = scored.response_mask
    expected = TASK_COEF * task_advantages(scored) + COEF * (teacher.log_probs - student) * mask
    torch.testing.assert_close(batch.advantages, expected, atol=1e-5, rtol=0)
    assert torch.equal(batch.teacher_log_probs, teacher.log_probs)
    assert batch.teacher_top_ids is None and batch.teacher_top_log_probs is None
    tokens = mask.sum()
    assert at.metrics["distill/reverse_kl"] == pytest.approx(
        float(((student - teacher.log_probs) * mask).sum() / tokens), abs=1e-6
    )
    assert at.metrics["distill/teacher_log_prob"] == pytest.approx(
        float(teacher.log_probs.sum() / tokens), abs=1e-6
    )
    assert "teacher" in at.timer.times
    assert build.components.workers.scored == [len(scored)]


def test_gkd_keeps_the_weighted_task_advantage_and_carries_the_top_k(tmp_path):
    scored = scored_batch()
    teacher = teacher_scores(scored, k=3)
    build = builder(tmp_path, "gkd", teacher)
    old = OldLogProbs(values=None, own=None, measured_in_update=True)
    batch = build.train_batch(scored, old, step_state())
    torch.testing.assert_close(
        batch.advantages, TASK_COEF * task_advantages(scored), atol=1e-5, rtol=0
    )
    assert torch.equal(batch.teacher_top_ids, teacher.top_ids)
    assert torch.equal(batch.teacher_top_log_probs, teacher.top_log_probs)
    assert torch.equal(batch.teacher_log_probs, teacher.log_probs)
