"""Samples told to the driver as they finish on a Ray rank: generate's `on_finished` across
processes.

A rank's engine calls a `TellDriver` for each sample it finishes; the teller puts (call, row,
(record, response text)) on a Ray queue without waiting for an answer, and one thread of the driver
drains the queue into the call's callback (the reward's `start`, which begins the sample's scoring
while the ranks still generate). Each rank ends its part with a marker that says how many samples it
told: the queue's actor may run puts out of the order sent, so the driver counts them until every
sample of a call has come through. A side channel: if it fails, the samples are scored with their
batch, as without it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("keel")

# how often the draining thread looks whether the channel was closed
DRAIN_POLL_S = 1.0
# the longest a finished batch waits for its samples' last tellings
ALL_TOLD_TIMEOUT_S = 120.0


@dataclass
class TellDriver:
    """What a rank calls as each sample finishes (`row`: its row in the rank's prompts); `close`
    after its last."""

    # the Ray queue's actor handle: it pickles to the rank
    queue_actor: object
    call: int
    # the rank's first row in the call's prompts
    offset: int
    told: int = 0

    def __call__(self, row: int, record, response_text: str) -> None:
        self.queue_actor.put_nowait.remote((self.call, self.offset + row, (record, response_text)))
        self.told += 1

    def close(self) -> None:
        self.queue_actor.put_nowait.remote((self.call, None, self.told))


class FinishedChannel:
    """One Ray queue and the driver thread that drains it, for every generate call of a group."""

    def __init__(self, channel_queue=None):
        """`channel_queue`: a Ray queue (one is made), or what a test puts tellings on."""
        if channel_queue is None:
            from ray.util.queue import Queue

            channel_queue = Queue(actor_options={"num_cpus": 0})
        self.queue = channel_queue
        # call -> (its callback, [ranks yet to close, samples yet to arrive], set once all have)
        self.calls: dict[int, tuple[Callable, list[int], threading.Event]] = {}
        self.next_call = 0
        self.closed = False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._drain, name="keel-finished", daemon=True)
        self.thread.start()

    def open(
        self, on_finished: Callable, offsets: list[int]
    ) -> tuple[int | None, list[TellDriver | None]]:
        """A generate call's tellers, one per rank (`offsets`: each rank's first row) -> (the call,
        them); none once the channel has stopped (the samples are then scored with their batch)."""
        with self.lock:
            if self.closed:
                return None, [None] * len(offsets)
            call, self.next_call = self.next_call, self.next_call + 1
            self.calls[call] = (on_finished, [len(offsets), 0], threading.Event())
        return call, [TellDriver(self.queue.actor, call, offset) for offset in offsets]

    def wait(self, call: int | None) -> None:
        """Until every rank of `call` has told all its samples (or ALL_TOLD_TIMEOUT_S: they are then
        scored with their batch, none lost)."""
        if call is None:
            return
        _, _, told = self.calls[call]
        if not told.wait(ALL_TOLD_TIMEOUT_S):
            log.warning(
                "samples finished on the workers were not all told in time; their batch "
                "scores the rest"
            )
        with self.lock:
            self.calls.pop(call, None)

    def _drain(self) -> None:
        while not self.closed:
            try:
                call, row, telling = self.queue.get(block=True, timeout=DRAIN_POLL_S)
            except queue.Empty:
                continue
            # the queue's actor is gone: samples score with their batch
            except Exception as error:  # noqa: BLE001
                if not self.closed:
                    log.warning(
                        "finished samples can no longer reach the driver early (%s); batches "
                        "score whole",
                        error,
                    )
                self._stop()
                return
            with self.lock:
                entry = self.calls.get(call)
            # a call that stopped waiting
            if entry is None:
                continue
            on_finished, left, all_told = entry
            # a rank closed: `telling` is how many samples it told
            if row is None:
                left[0], left[1] = left[0] - 1, left[1] + telling
            else:
                left[1] -= 1
                try:
                    # the sample's record and response text
                    on_finished(row, *telling)
                # the sample is scored with its batch, which says any error
                except Exception:  # noqa: BLE001
                    log.exception(
                        "beginning a finished sample's scoring failed; its batch scores it"
                    )
            if left == [0, 0]:
                all_told.set()

    def _stop(self) -> None:
        """No more tellings: every waiting call is released (its batch scores what was not told)."""
        with self.lock:
            self.closed = True
            for _, _, told in self.calls.values():
                told.set()

    def shutdown(self) -> None:
        self._stop()
        self.queue.shutdown()
