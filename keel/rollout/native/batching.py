"""Continuous batching in the native engine: a sequence keeps a row of one KV cache for as long as
it lasts (every turn of a multi-turn episode), and each decode step runs over the rows generating
now, whatever each one's position.

- A sequence that stops (a stop token, its turn's limit) leaves the decode batch and keeps its KV.
  When it comes back with new tokens (a tool's output and the template's next prompt, a user turn),
  only those are prefilled, after its cached columns.
- Sequences waiting for a row take the rows of finished ones: the long tail of single-turn
  rollouts with EOS decodes beside new prompts instead of alone.

The batcher is the step both of the engine's drivers run (`generate`'s loop, `drive`, and the
engine service's): it asks the scheduler (scheduler.py, no tensors) what to run, runs it on the
rows' device state (decode_state.py: the cache, the turn state, a CUDA graph per batch bucket) and
tells the scheduler what happened.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from keel.rollout.native.decode_state import DecodeState
from keel.rollout.native.runner import ModelRunner
from keel.rollout.native.scheduler import Finished, Scheduler
from keel.rollout.native.state import Clock
from keel.types import SamplingParams

# decode steps between looks at which turns ended (a host sync)
DONE_CHECK_EVERY = 16


class ContinuousBatcher:
    """Sequences added with `add` generate one turn each time they are added; `step` admits,
    decodes a few steps and returns the turns that ended; `release` gives a sequence's row back."""

    def __init__(
        self,
        runner: ModelRunner,
        eos: Tensor,
        shape: tuple[int, int, int],
        prefill_budget: int,
        timing: dict[str, float],
    ):
        """`shape`: rows, tokens a row holds, tokens a turn may take; `prefill_budget`: tokens one
        prefill pass takes (max_num_batched_tokens); `timing`: where seconds per part add up."""
        self.shape, self.timing, self.device = shape, timing, runner.device
        self.scheduler = Scheduler(shape)
        self.decoding = DecodeState(runner, eos, shape, prefill_budget)

    def reset(self) -> None:
        """Every row free (a kept batcher, reused by the next call)."""
        self.scheduler.reset()
        self.decoding.reset()

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    @property
    def runnable(self) -> bool:
        """Whether `step` has work now: rows decoding, or a waiting turn with a row to take."""
        return self.scheduler.runnable

    def add(self, key, context: list[int], limit: int, group=None) -> None:
        """A turn for `key`: a new sequence, or one returning with its context extended."""
        self.scheduler.add(key, context, limit, group)

    def release(self, key) -> None:
        """`key`'s row goes back: its KV cache is dropped."""
        self.scheduler.release(key)

    def cut(self) -> list[Finished]:
        """Every turn under way ended where it is (a partial rollout's round ends): what each row
        decoding has sampled so far; turns still waiting for a row are dropped with none."""
        return self._read(self.scheduler.cut())

    @torch.no_grad()
    def step(self, params: SamplingParams, look_every: int | None = None) -> list[Finished]:
        """Admit what has a row, decode up to DONE_CHECK_EVERY (or `look_every`) steps -> the turns
        that ended."""
        self.decoding.use(params)
        clock = Clock(self.device)
        finished = self._admit(params)
        clock.lap("prefill")
        scheduler = self.scheduler
        if scheduler.active:
            steps = scheduler.decode_steps(params.ignore_eos, DONE_CHECK_EVERY, look_every)
            run = self.decoding.bucket_step(scheduler.active, params)
            clock.lap("capture")
            for _ in range(steps):
                run()
            ended = scheduler.decoded(steps, self.decoding.done(scheduler.active))
            finished += self._read(ended)
            clock.lap("decode")
        for part, seconds in clock.laps.items():
            self.timing[part] = self.timing.get(part, 0.0) + seconds
        return finished

    def _admit(self, params: SamplingParams) -> list[Finished]:
        """Prefill of the new tokens of the turns that take a row, and each one's first token."""
        admitted = self.scheduler.admit()
        if not admitted:
            return []
        rows = [a.row for a in admitted]
        logits = self.decoding.prefill([(a.row, a.start, a.new, a.group) for a in admitted])
        lengths = [len(self.scheduler.contexts[row]) for row in rows]
        ended = self.decoding.first_token(
            rows, lengths, [a.limit for a in admitted], logits, params
        )
        return self._read(self.scheduler.started(admitted, ended))

    def _read(self, rows: list[int]) -> list[Finished]:
        """The ended turns of `rows`, their tokens added to the rows' contexts."""
        if not rows:
            return []
        return [
            self.scheduler.finish(row, ids, log_probs)
            for row, (ids, log_probs) in zip(rows, self.decoding.read(rows))
        ]


def drive(
    batcher: ContinuousBatcher, params: SamplingParams, until: Callable[[], bool] | None = None
) -> Iterator[Finished]:
    """The batcher stepped until no turn is left (or `until()` says so, looked at between steps):
    each turn as it ends, its row released. The plain run loop, on the caller's thread: no hop
    and no host sync beyond the step's own."""
    while batcher.busy and not (until is not None and until()):
        for turn in batcher.step(params):
            batcher.release(turn.key)
            yield turn
