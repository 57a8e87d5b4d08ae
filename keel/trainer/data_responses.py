"""GKD's off-policy steps (distillation.gkd.lmbda < 1, TRL's GKDConfig.lmbda): each step trains on
the student's own samples with probability lmbda, else on the data's responses.

The draw is a pure function of the step's seed (keel/trainer/seeds.py), so a resumed run draws what
an uninterrupted one would. A data step takes the sampler's next prompts, as a sampled step would,
and answers each with its row's `distillation.response_key` column, tokenized after the prompt as
a generated response is (EOS appended, cut at data.max_response_length). Each prompt is repeated
rollout.n times, as a sampled step's are: the step's batch then has the shape the batch plan
divided into mini- and micro-batches and ranks, and n copies of every row leave each loss (a mean
over tokens or sequences) as it would be with one.
The samples are marked `from_data`: the gap guard, rollout correction and the policy gradient
leave them alone, and their old log-probs come from the pass.

Only sync steps (RolloutWithin) draw: keel.config.gkd_rules refuses lmbda < 1 elsewhere. The rows'
responses (keel/data/responses.py) are read, and checked, with the prompts (keel check too), and
each prompt's record carries its own.
"""

from __future__ import annotations

import dataclasses
import random

from keel.config.schema import KeelConfig
from keel.data.prompts import collate_prompts
from keel.data.responses import data_batch, trains_on_responses
from keel.observe.metrics import Timer
from keel.trainer.scored_rollout import ScoredRollout
from keel.trainer.seeds import on_policy_draw_seed, step_seed
from keel.types import GenerationResult, StepSamples

ON_POLICY = "distill/on_policy"


def on_policy_step(cfg: KeelConfig, step: int) -> bool:
    """Whether step `step` trains on the student's samples: true with probability
    distillation.gkd.lmbda, drawn from the step's seed."""
    lmbda = cfg.distillation.gkd.lmbda
    if lmbda >= 1:
        return True
    return random.Random(on_policy_draw_seed(step_seed(cfg, step))).random() < lmbda


def with_data_steps(cfg: KeelConfig, within, rollout: ScoredRollout):
    """The sync rollout `within`, or with lmbda < 1 under gkd, a rollout that trains some steps on
    the data's responses instead."""
    if not trains_on_responses(cfg):
        return within
    return RolloutWithData(cfg, within, DataResponses(cfg, rollout))


class RolloutWithData:
    """trainer.mode=sync with gkd's lmbda < 1: a step's samples are the student's (`within`'s) or
    the data's responses, as the step's draw says; `distill/on_policy` says which (1 or 0)."""

    def __init__(self, cfg: KeelConfig, within, responses: DataResponses):
        self.cfg, self.within, self.responses = cfg, within, responses

    def __call__(self, timer: Timer, step: int) -> StepSamples:
        on_policy = on_policy_step(self.cfg, step)
        samples = self.within(timer, step) if on_policy else self.responses(timer)
        metrics = {**samples.metrics, ON_POLICY: float(on_policy)}
        return dataclasses.replace(samples, metrics=metrics)

    def settle(self) -> None:
        self.within.settle()

    def resume_state(self) -> tuple[dict, dict]:
        return self.within.resume_state()

    def start_at(self, step: int, state: dict | None = None) -> None:
        self.within.start_at(step, state)

    def close(self) -> None:
        self.within.close()


class DataResponses:
    """A data step's samples: the sampler's next prompts, each answered rollout.n times with its
    row's response, then scored as generated samples are (the reward metrics show the data's
    scores)."""

    def __init__(self, cfg: KeelConfig, rollout: ScoredRollout):
        self.cfg, self.rollout = cfg, rollout

    def __call__(self, timer: Timer) -> StepSamples:
        parts, n = self.rollout.components, self.cfg.actor_rollout_ref.rollout.n
        tokenizer = parts.tokenizer
        records = [parts.train_data[i] for i in parts.sampler.next_batch()]
        prompts = collate_prompts(records, tokenizer.pad_token_id).repeat_interleave(n)
        with timer("data_responses"):
            batch = data_batch(
                prompts,
                # read with the prompts (keel.trainer.setup.read_prompts)
                [r.response for r in prompts.records],
                tokenizer,
                self.cfg.data.max_response_length,
            )
        with timer("reward"):
            samples = self.rollout.score(GenerationResult(batch=batch, timing={}))
        if self.rollout.needs_baseline:
            # ReMax: each response is its own baseline (no greedy rollout, no advantage)
            scored = dataclasses.replace(samples.batch, baselines=samples.batch.scores)
            samples = dataclasses.replace(samples, batch=scored)
        return samples
