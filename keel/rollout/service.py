"""The native engine as a service during a rollout: requests arrive at any time, from any thread
(keel's agent loop, an OpenAI-compatible HTTP server), and one run loop batches whatever is
pending into the engine's continuous batch, answering each as it finishes.

A request is one turn of a sequence named by its key: its whole context so far and how many tokens
the turn may take. A key keeps its row of the KV cache between turns, so a turn that extends the
key's last context (its prompt, the tokens sampled, then whatever came after) prefills only the new
tokens. A turn that does not extend it (the client rewrote the history) starts the key again on a
fresh row: the answer is right either way, and `Completion.extended` says which it was. The
sampling settings are the service's for its life: the captured CUDA graphs hold them.

Turns that arrive one request at a time (an HTTP endpoint's) would each be admitted in a prefill
pass of its own. With an admission window, arriving turns are held until arrivals go quiet for the
window (or the first has waited four windows) and admitted together, in one pass; rows already
decoding go on meanwhile.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

from keel.types import SamplingParams

# decode steps at most between looks for arrived turns (a host sync each)
LOOK_EVERY = 16


@dataclass
class Completion:
    """A turn's sampled tokens (the stop token included) with their log-probs."""

    ids: list[int]
    log_probs: list[float]
    # ended by a stop token (else by the turn's token limit)
    stopped: bool
    # the context extended the key's previous one (its KV cache was kept)
    extended: bool


@dataclass
class _Turn:
    key: object
    context: list[int]
    limit: int
    future: Future
    # turns of one group share their first prompt's prefill
    group: object = None
    # told ("turns", [(key, future)]) once the turn is answered
    notify: queue.Queue | None = None
    extended: bool = False
    # time.monotonic() when the run loop accepted it
    arrived: float = 0.0


@dataclass
class _End:
    key: object


class EngineService:
    """`submit` a turn -> a Future of its Completion; `end` a key when its episode is over (its row
    goes to a waiting key). Up to `sequences` keys hold rows at once; more wait for one."""

    def __init__(
        self,
        engine,
        params: SamplingParams,
        sequences: int,
        max_len: int,
        turn_tokens: int,
        admission_s: float = 0.0,
        groups: dict | None = None,
    ):
        """`groups`: key -> its group, for clients that cannot say it (an HTTP endpoint's): keys of
        one group whose first turns are admitted together with the same tokens share one prefill.
        Given, it names every key of the service's life: others are refused."""
        self.engine, self.params, self.groups = engine, params, groups or {}
        self.shape = (sequences, max_len, turn_tokens)
        self.batcher = engine.continuous_batcher(sequences, max_len, turn_tokens)
        self.stop_ids = set(engine.eos_ids)
        self.inbox: queue.Queue = queue.Queue()
        # key -> its turn under way
        self.pending: dict[object, _Turn] = {}
        # key -> its last context and what was sampled after it
        self.contexts: dict[object, list[int]] = {}
        # keys ended while a turn of theirs was under way
        self.ending: set = set()
        # keys whose episode is over
        self.ended: set = set()
        # accepted, not yet in the batch: admitted together
        self.window = _AdmissionWindow(admission_s)
        # the notify queues of submit_many, and what they are told
        self.clients = _Clients()
        self.error: BaseException | None = None
        # what the run loop did: admissions (prefill passes of held turns), turns, decode calls (up
        # to LOOK_EVERY steps each) and the rows they stepped, seconds with nothing to run (waiting
        # on clients)
        self.stats = {"admissions": 0, "turns": 0, "decode_calls": 0, "row_steps": 0, "idle_s": 0.0}
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="keel-engine", daemon=True)
        self._thread.start()

    def submit(self, key, context: list[int], limit: int) -> Future:
        """A turn for `key` of at most `limit` tokens after `context`."""
        (future,) = self.submit_many([(key, context, limit, None)])
        return future

    def submit_many(self, turns: list[tuple], notify: queue.Queue | None = None) -> list[Future]:
        """Turns (key, context, limit, group) arriving together: the run loop takes them at once, so
        they are admitted in one prefill pass. With `notify`, the turns a decode step ends (or that
        are refused) are put there together as ("turns", [(key, future), ...]), and ("closed",
        error) if the service ends first: a client of many turns waits on one queue, not on each
        future."""
        accepted, refused = [], []
        for key, context, limit, group in turns:
            turn = _Turn(key, list(context), limit, Future(), group, notify)
            why = _unfit(self.shape, context, limit)
            if why is None:
                accepted.append(turn)
            else:
                turn.future.set_exception(ValueError(why))
                refused.append(turn)
        # against the run loop's last drain: turns are queued before it, or refused
        with self._lock:
            # told "closed" however the service ends
            if notify is not None:
                self.clients.queues.add(notify)
            if self._closed.is_set():
                closed = RuntimeError(f"the engine service is closed ({self.error or 'closed'})")
                for turn in accepted:
                    turn.future.set_exception(closed)
                refused, accepted = refused + accepted, []
            elif accepted:
                self.inbox.put(accepted)
        if notify is not None and refused:
            notify.put(("turns", [(turn.key, turn.future) for turn in refused]))
        return [turn.future for turn in accepted + refused]

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
                    self._take_requests(self.window.until_due())
                    self.stats["idle_s"] += time.monotonic() - idle
                self._admit_held()
                if self.batcher.runnable:
                    finished = self.batcher.step(self.params, look_every=LOOK_EVERY)
                    self.stats["decode_calls"] += 1
                    # the rows it stepped
                    self.stats["row_steps"] += len(self.batcher.scheduler.active) + len(finished)
                    for turn in finished:
                        self._answer(turn)
                self.clients.tell()
        except BaseException as error:  # noqa: BLE001 - every waiting client is told, none hangs
            self.error = error
        self._refuse_the_rest(self.error or RuntimeError("the engine service closed"))

    def _refuse_the_rest(self, closed: BaseException) -> None:
        # held turns are pending too
        unanswered = list(self.pending.values())
        with self._lock:
            # submit refuses from here on; what reached the inbox before is answered below
            self._closed.set()
            while not self.inbox.empty():
                item = self.inbox.get_nowait()
                if isinstance(item, list):
                    unanswered += item
        for turn in unanswered:
            self.clients.settle(turn, exception=closed)
        self.pending.clear()
        self.clients.tell()
        self.clients.tell_closed(closed, self._lock)

    def _take_requests(self, wait: float | None) -> None:
        """Everything in the inbox; with `wait` (nothing else to do), first waits that long for one
        (inf: until one comes)."""
        try:
            item = (
                self.inbox.get(timeout=None if wait == float("inf") else wait)
                if wait
                else self.inbox.get_nowait()
            )
            while True:
                if isinstance(item, _End):
                    self._end(item.key)
                for turn in item if isinstance(item, list) else []:
                    self._accept(turn)
                item = self.inbox.get_nowait()
        except queue.Empty:
            return

    def _end(self, key) -> None:
        # a turn of its that arrives later is refused: its row would never be freed
        self.ended.add(key)
        self.contexts.pop(key, None)
        # a turn under way (its client gave up): the row goes when it ends
        if key in self.pending:
            self.ending.add(key)
        elif self.batcher.scheduler.holds(key):
            self.batcher.release(key)

    def _accept(self, turn: _Turn) -> None:
        previous = self.contexts.get(turn.key)
        turn.extended = previous is not None and turn.context[: len(previous)] == previous
        why = _refusal(turn, previous, self.groups, self.pending, self.ended)
        if why is not None:
            self.clients.settle(turn, exception=ValueError(why))
            return
        if self.batcher.scheduler.holds(turn.key) and not turn.extended:
            # the history was rewritten: start again on a fresh row
            self.batcher.release(turn.key)
        self.pending[turn.key] = turn
        self.window.hold(turn)

    def _admit_held(self) -> None:
        """The held turns into the batch once they are due: one prefill pass for them all."""
        due = self.window.take_due()
        if due:
            self.stats["admissions"] += 1
            self.stats["turns"] += len(due)
            for turn in due:
                group = turn.group if turn.group is not None else self.groups.get(turn.key)
                self.batcher.add(turn.key, turn.context, turn.limit, group=group)

    def _answer(self, finished) -> None:
        turn = self.pending.pop(finished.key)
        if finished.key in self.ending:
            self.ending.discard(finished.key)
            self.batcher.release(finished.key)
        else:
            self.contexts[finished.key] = turn.context + finished.ids
        stopped = bool(finished.ids) and finished.ids[-1] in self.stop_ids
        self.clients.settle(
            turn, Completion(finished.ids, finished.log_probs, stopped, turn.extended)
        )


class _AdmissionWindow:
    """Accepted turns held until arrivals go quiet for `seconds` (or the first has waited four
    windows), then admitted together."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.held: list[_Turn] = []

    def hold(self, turn: _Turn) -> None:
        turn.arrived = time.monotonic()
        self.held.append(turn)

    def until_due(self) -> float:
        """Seconds until the held turns are due (inf: none held, wait for a request)."""
        if not self.held:
            return float("inf")
        now = time.monotonic()
        quiet = self.held[-1].arrived + self.seconds - now
        return max(0.0, min(quiet, self.held[0].arrived + 4 * self.seconds - now))

    def take_due(self) -> list[_Turn]:
        """The held turns if they are due (none held from then), else none."""
        if not self.held or self.until_due() > 0.0:
            return []
        due, self.held = self.held, []
        return due


class _Clients:
    """The notify queues of submit_many, and the turns answered since each was last told."""

    def __init__(self):
        self.queues: set[queue.Queue] = set()
        # answered turns not yet put on their client's queue
        self.told: dict[queue.Queue, list[_Turn]] = {}

    def settle(self, turn: _Turn, result=None, exception: BaseException | None = None) -> None:
        _settle(turn.future, result, exception)
        if turn.notify is not None:
            self.told.setdefault(turn.notify, []).append(turn)

    def tell(self) -> None:
        """Each client's turns answered since it was last told, in one message."""
        for client, turns in self.told.items():
            client.put(("turns", [(turn.key, turn.future) for turn in turns]))
        self.told = {}

    def tell_closed(self, closed: BaseException, lock: threading.Lock) -> None:
        """Every client told the service ended (`lock`: against a client joining meanwhile)."""
        with lock:
            queues = list(self.queues)
        for client in queues:
            client.put(("closed", closed))


def _unfit(shape: tuple[int, int, int], context: list[int], limit: int) -> str | None:
    """Why a turn cannot fit the service's rows (None: it fits)."""
    _, max_len, turn_tokens = shape
    if not context:
        return "an empty context: a turn needs at least one token before it"
    if not 0 < limit <= turn_tokens or len(context) + limit > max_len:
        return (
            f"{len(context)} tokens and {limit} more exceed {max_len} (turns of {turn_tokens} at "
            "most)"
        )
    return None


def _refusal(turn: _Turn, previous: list[int] | None, groups, pending, ended) -> str | None:
    """Why the run loop refuses a turn it takes (None: it is accepted); `turn.extended` is set."""
    # a late request of an earlier rollout's sample
    if groups and turn.key not in groups:
        return f"{turn.key!r} is not a sample of this rollout"
    if turn.key in pending or turn.key in ended:
        why = "already has a turn under way" if turn.key in pending else "was ended"
        return f"{turn.key!r} {why}"
    if turn.extended and len(turn.context) == len(previous):
        return f"{turn.key!r} came back with no new tokens"
    return None


def _settle(future: Future, result=None, exception: BaseException | None = None) -> None:
    """Answer a future unless its client gave up (cancelled it, possibly while this runs)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
