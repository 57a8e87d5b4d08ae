"""Where a step's scored samples come from: generated and scored within the step (trainer.mode=sync,
RolloutWithin), or ahead of it (async, RolloutAhead), which the rest of this docstring is about.

In async mode generation runs ahead of training, by up to max_off_policy_steps batches.

Step j trains batch j. Before it does, every batch up to j + k (k = max_off_policy_steps, never past
the run's last step) has been generated, each with the policy of the step that generated it, and
handed to a scoring thread. So while the trainer waits on nothing, the host scores batch j+1 as the
GPU updates on batch j and generates batch j+k+1: rewards that take seconds (a code jail, a judge)
no longer add to the step. Generation and training still take turns on the workers (one GPU, one
process per rank), in the order a synchronous run would call them when k = 0, which then is the
synchronous run exactly: the same prompts, seeds, samples and updates.

A batch generated at step g and trained at step j was sampled from the policy of `version(g - 1)`
and updates the one of `version(j - 1)`: its staleness, at most k. Rollout correction is on for
k >= 1 (keel.config.plan turns it on when nothing else corrects).

A checkpoint records the sampler where the oldest untrained batch drew its prompts: batches in
flight are dropped at a resume and their prompts generated again, never lost or trained twice.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from keel.config.schema import KeelConfig
from keel.config.trainer import OffPolicy
from keel.data.sampler import ResumableSampler
from keel.observe.metrics import Timer
from keel.trainer.data_responses import with_data_steps
from keel.trainer.partial import RolloutPartial
from keel.trainer.scored_rollout import ScoredRollout
from keel.trainer.seeds import step_seed
from keel.types import StepSamples


@dataclass
class InFlight:
    """A generated batch on its way to training."""

    # the step that trains it
    step: int
    # the sampler before it drew the batch's prompts: where a resume starts again
    sampler_state: dict
    # -> its StepSamples (timing_s/reward: the seconds its scoring took)
    scored: Future


class StepRollout(Protocol):
    """Where a step's scored samples come from: the trainer.mode's strategy."""

    def __call__(self, timer: Timer, step: int) -> StepSamples:
        """The samples step `step` trains, scored, with reward metrics and generation timing."""

    def settle(self) -> None:
        """Every batch in flight scored: the reward function is free for validation's use."""

    def resume_state(self) -> tuple[dict, dict]:
        """(the sampler state a resume starts from, what else it needs in the checkpoint)."""

    def start_at(self, step: int, state: dict | None = None) -> None:
        """A run (resumed) after `step`, with the checkpoint's trainer state."""

    def close(self) -> None:
        """What is in flight dropped: the run ends."""


def step_rollout(
    cfg: KeelConfig,
    off_policy: OffPolicy,
    rollout: ScoredRollout,
    sampler: ResumableSampler,
    last_step: int,
) -> StepRollout:
    """The off-policy value's rollout (the plan's). With partial rollouts, a pool of samples under
    way (keel/trainer/partial.py). Sync steps may train on the data's responses instead
    (distillation.gkd.lmbda < 1, keel/trainer/data_responses.py)."""
    if not off_policy.ahead:
        return with_data_steps(cfg, RolloutWithin(cfg, rollout, sampler), rollout)
    if off_policy.partial:
        return RolloutPartial(cfg, rollout, sampler)
    return RolloutAhead(cfg, rollout, sampler, last_step)


class RolloutWithin:
    """trainer.mode=sync: each step generates and scores its own batch, from the policy it starts
    with."""

    def __init__(self, cfg: KeelConfig, rollout: ScoredRollout, sampler: ResumableSampler):
        self.cfg, self.rollout, self.sampler = cfg, rollout, sampler

    def __call__(self, timer: Timer, step: int) -> StepSamples:
        return self.rollout(timer, step_seed(self.cfg, step))

    def settle(self) -> None:
        """Nothing is in flight between steps."""

    def resume_state(self) -> tuple[dict, dict]:
        return self.sampler.state_dict(), {}

    def start_at(self, step: int, state: dict | None = None) -> None:
        """A resumed run draws on from the sampler's restored position."""

    def close(self) -> None:
        """No thread of its own to stop."""


class RolloutAhead:
    """trainer.mode=async: `rollout(timer, step)` -> the batch step `step` trains, generated
    ahead."""

    def __init__(
        self, cfg: KeelConfig, rollout: ScoredRollout, sampler: ResumableSampler, last_step: int
    ):
        self.cfg, self.rollout, self.sampler, self.last_step = cfg, rollout, sampler, last_step
        self.bound = cfg.trainer.max_off_policy_steps
        self.in_flight: deque[InFlight] = deque()
        self.scoring = ThreadPoolExecutor(max_workers=1, thread_name_prefix="keel-scoring")
        # the last step whose batch is generated
        self.generated = 0
        self.closed = False

    def start_at(self, step: int, state: dict | None = None) -> None:
        """A run resumed after `step`: its next batch is step + 1's."""
        self.generated = step

    def __call__(self, timer: Timer, step: int) -> StepSamples:
        """Batch `step`'s scored samples, with reward and staleness metrics and the timing of its
        generation: what ScoredRollout returns in sync mode."""
        while self.generated < min(step + self.bound, self.last_step):
            self._generate(timer)
        flight = self.in_flight.popleft()
        # what scoring (and a rollout of its own, generating) still took
        with timer("wait_reward"):
            samples: StepSamples = flight.scored.result()
        # the versions the workers stamped on the samples against the policy this step updates
        workers = self.rollout.components.workers
        staleness = (workers.policy_version - samples.batch.policy_version).float()
        metrics = {
            **samples.metrics,
            "async/staleness/mean": staleness.mean().item(),
            "async/staleness/max": staleness.max().item(),
            "async/in_flight": float(len(self.in_flight)),
        }
        return dataclasses.replace(samples, metrics=metrics)

    def _generate(self, timer: Timer) -> None:
        """The next batch, from the policy the rollout's workers hold, then scored: generated now on
        the actor's workers, or started on the rollout's own (the driver goes on to train
        meanwhile)."""
        self.generated += 1
        state, seed = self.sampler.state_dict(), step_seed(self.cfg, self.generated)
        if self.rollout.apart:
            generated = self.rollout.submit_generate(seed)
        else:
            generated = Future()
            generated.set_result(self.rollout.generate(timer, seed))
        self.in_flight.append(
            InFlight(self.generated, state, self.scoring.submit(self._score, generated))
        )

    def _score(self, generated: Future) -> StepSamples:
        """The generation's samples scored, with the seconds scoring took (timing_s/reward)."""
        done = generated.result()
        if self.closed:
            raise CancelledError("the run ended with this batch in flight")
        start = time.perf_counter()
        samples = self.rollout.score(done)
        seconds = time.perf_counter() - start
        return dataclasses.replace(samples, metrics={**samples.metrics, "timing_s/reward": seconds})

    def settle(self) -> None:
        """Every batch in flight scored: the reward function is then free for validation's use."""
        for flight in self.in_flight:
            # waits; an error is raised when its step takes the batch
            flight.scored.exception()

    def resume_state(self) -> tuple[dict, dict]:
        """(the sampler state a resume starts from, and how many batches in flight it drops)."""
        if not self.in_flight:
            return self.sampler.state_dict(), {}
        return self.in_flight[0].sampler_state, {"in_flight_dropped": len(self.in_flight)}

    def close(self) -> None:
        """Batches in flight are dropped: scoring not begun is cancelled and none begins after this
        (the reward function stops next); a run stopped mid-step does not wait for a generation to
        end."""
        self.closed = True
        self.scoring.shutdown(wait=False, cancel_futures=True)
