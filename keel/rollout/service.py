"""The native engine as a service during a rollout: requests arrive at any time, from any thread
(keel's agent loop, an OpenAI-compatible HTTP server), and one run loop batches whatever is
pending into the engine's continuous batch, answering each as it finishes.

A request is one turn of a sequence named by its key: its whole context so far and how many tokens
the turn may take. A key keeps its row of the KV cache between turns, so a turn that extends the
key's last context (its prompt, the tokens sampled, then whatever came after) prefills only the new
tokens. A turn that does not extend it (the client rewrote the history) starts the key again on a
fresh row: the answer is right either way, and `Completion.extended` says which it was. The
sampling settings are the service's for its life: the captured CUDA graphs hold them.

Turns that arrive one request at a time (an HTTP endpoint's) would each be admitted in a prefill pass
of its own. With an admission window, arriving turns are held until arrivals go quiet for the window
(or the first has waited four windows) and admitted together, in one pass; rows already decoding go
on meanwhile.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

from keel.types import SamplingParams

LOOK_EVERY = 16  # decode steps at most between looks for arrived turns (a host sync each)


@dataclass
class Completion:
    """A turn's sampled tokens (the stop token included) with their log-probs."""

    ids: list[int]
    log_probs: list[float]
    stopped: bool  # ended by a stop token (else by the turn's token limit)
    extended: bool  # the context extended the key's previous one (its KV cache was kept)


@dataclass
class _Turn:
    key: object
    context: list[int]
    limit: int
    future: Future
    extended: bool = False
    arrived: float = 0.0  # time.monotonic() when the run loop accepted it


@dataclass
class _End:
    key: object


class EngineService:
    """`submit` a turn -> a Future of its Completion; `end` a key when its episode is over (its row
    goes to a waiting key). Up to `sequences` keys hold rows at once; more wait for one."""

    def __init__(
        self, engine, params: SamplingParams, sequences: int, max_len: int, turn_tokens: int, admission_s: float = 0.0
    ):
        self.engine, self.params, self.admission_s = engine, params, admission_s
        self.shape = (sequences, max_len, turn_tokens)
        self.batcher = engine.continuous_batcher(sequences, max_len, turn_tokens)
        self.stop_ids = set(engine.eos_ids)
        self.inbox: queue.Queue = queue.Queue()
        self.pending: dict[object, _Turn] = {}  # key -> its turn under way
        self.contexts: dict[object, list[int]] = {}  # key -> its last context and what was sampled after it
        self.ending: set = set()  # keys ended while a turn of theirs was under way
        self.ended: set = set()  # keys whose episode is over
        self.held: list[_Turn] = []  # accepted, not yet in the batch: admitted together (the admission window)
        self.error: BaseException | None = None
        # what the run loop did: admissions (prefill passes of held turns), turns, decode calls (up to
        # LOOK_EVERY steps each) and the rows they stepped, seconds with nothing to run (waiting on clients)
        self.stats = {"admissions": 0, "turns": 0, "decode_calls": 0, "row_steps": 0, "idle_s": 0.0}
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="keel-engine", daemon=True)
        self._thread.start()

    def submit(self, key, context: list[int], limit: int) -> Future:
        """A turn for `key` of at most `limit` tokens after `context`."""
        future: Future = Future()
        _, max_len, turn_tokens = self.shape
        if not context:
            future.set_exception(ValueError("an empty context: a turn needs at least one token before it"))
        elif not 0 < limit <= turn_tokens or len(context) + limit > max_len:
            future.set_exception(
                ValueError(f"{len(context)} tokens and {limit} more exceed {max_len} (turns of {turn_tokens} at most)")
            )
        else:
            with self._lock:  # against the run loop's last drain: a turn is queued before it, or refused
                if self._closed.is_set():
                    future.set_exception(RuntimeError(f"the engine service is closed ({self.error or 'closed'})"))
                else:
                    self.inbox.put(_Turn(key, list(context), limit, future))
        return future

    def end(self, key) -> None:
        """The key's episode is over: its row is free for another."""
        self.inbox.put(_End(key))

    def close(self) -> None:
        self._closed.set()
        self.inbox.put(None)
        self._thread.join()

    # --- the run loop (its own thread: the only one that touches the batcher) -------------------
    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                if self.batcher.runnable:
                    self._take_requests(None)
                else:
                    idle = time.monotonic()
                    self._take_requests(self._until_admission())
                    self.stats["idle_s"] += time.monotonic() - idle
                self._admit_held()
                if self.batcher.runnable:
                    finished = self.batcher.step(self.params, look_every=LOOK_EVERY)
                    self.stats["decode_calls"] += 1
                    self.stats["row_steps"] += len(self.batcher.active) + len(finished)  # the rows it stepped
                    for turn in finished:
                        self._answer(turn)
        except BaseException as error:  # noqa: BLE001 - every waiting client is told, none hangs
            self.error = error
        closed = self.error or RuntimeError("the engine service closed")
        unanswered = list(self.pending.values())  # held turns are pending too
        with self._lock:
            self._closed.set()  # submit refuses from here on; what reached the inbox before is answered below
            while not self.inbox.empty():
                item = self.inbox.get_nowait()
                if isinstance(item, _Turn):
                    unanswered.append(item)
        for turn in unanswered:
            _settle(turn.future, exception=closed)
        self.pending.clear()

    def _take_requests(self, wait: float | None) -> None:
        """Everything in the inbox; with `wait` (nothing else to do), first waits that long for one
        (inf: until one comes)."""
        try:
            item = self.inbox.get(timeout=None if wait == float("inf") else wait) if wait else self.inbox.get_nowait()
            while True:
                if item is not None:
                    self._accept(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            return

    def _accept(self, item) -> None:
        if isinstance(item, _End):
            self.ended.add(item.key)  # a turn of its that arrives later is refused: its row would never be freed
            self.contexts.pop(item.key, None)
            if item.key in self.pending:  # a turn under way (its client gave up): the row goes when it ends
                self.ending.add(item.key)
            elif item.key in self.batcher.row_of:
                self.batcher.release(item.key)
            return
        if item.key in self.pending or item.key in self.ended:
            why = "already has a turn under way" if item.key in self.pending else "was ended"
            _settle(item.future, exception=ValueError(f"{item.key!r} {why}"))
            return
        previous = self.contexts.get(item.key)
        item.extended = previous is not None and item.context[: len(previous)] == previous
        if item.extended and len(item.context) == len(previous):
            _settle(item.future, exception=ValueError(f"{item.key!r} came back with no new tokens"))
            return
        if item.key in self.batcher.row_of and not item.extended:
            self.batcher.release(item.key)  # the history was rewritten: start again on a fresh row
        self.pending[item.key] = item
        item.arrived = time.monotonic()
        self.held.append(item)

    def _until_admission(self) -> float:
        """Seconds until the held turns are due (inf: none held, wait for a request)."""
        if not self.held:
            return float("inf")
        now = time.monotonic()
        quiet = self.held[-1].arrived + self.admission_s - now
        return max(0.0, min(quiet, self.held[0].arrived + 4 * self.admission_s - now))

    def _admit_held(self) -> None:
        """The held turns into the batch, once arrivals went quiet for the window (or the first
        waited four windows): one prefill pass for them all."""
        if self.held and self._until_admission() <= 0.0:
            self.stats["admissions"] += 1
            self.stats["turns"] += len(self.held)
            for turn in self.held:
                self.batcher.add(turn.key, turn.context, turn.limit)
            self.held = []

    def _answer(self, finished) -> None:
        turn = self.pending.pop(finished.key)
        if finished.key in self.ending:
            self.ending.discard(finished.key)
            self.batcher.release(finished.key)
        else:
            self.contexts[finished.key] = turn.context + finished.ids
        stopped = bool(finished.ids) and finished.ids[-1] in self.stop_ids
        _settle(turn.future, Completion(finished.ids, finished.log_probs, stopped, turn.extended))


def _settle(future: Future, result=None, exception: BaseException | None = None) -> None:
    """Answer a future unless its client gave up (cancelled it, possibly while this runs)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
