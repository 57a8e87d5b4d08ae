"""The driver's side of samples told as they finish on Ray ranks (keel/distributed/finished.py),
with a stand-in for the Ray queue: tellings that arrive out of order are counted until every rank
has told all its samples; a queue that dies releases every waiting batch, which then scores its
samples itself."""

import queue
import threading
from types import SimpleNamespace

from keel.distributed.finished import FinishedChannel

DIE = object()


class StandInQueue:
    """What FinishedChannel reads from: a Ray queue's get, and its actor for the tellers."""

    def __init__(self):
        self.items: queue.Queue = queue.Queue()
        self.actor = SimpleNamespace(put_nowait=SimpleNamespace(remote=self.items.put))

    def get(self, block=True, timeout=None):
        item = self.items.get(block, timeout)
        if item is DIE:
            raise RuntimeError("the queue's actor died")
        return item

    def shutdown(self):
        self.items.put(DIE)


def test_a_call_is_told_once_every_rank_has_closed_and_every_sample_arrived():
    told, arrived = [], threading.Event()
    channel = FinishedChannel(StandInQueue())
    call, (rank0, rank1) = channel.open(lambda row, record, text: told.append((row, text)), [0, 2])
    # rank 1 told nothing: its close says 0
    rank1.close()
    # rank 0's close, arriving before its samples
    channel.queue.items.put((call, None, 2))
    threading.Thread(target=lambda: (channel.wait(call), arrived.set())).start()
    rank0(1, "record b", "b")
    rank0(0, "record a", "a")
    assert arrived.wait(timeout=60)
    assert sorted(told) == [(0, "a"), (1, "b")]
    channel.shutdown()


def test_a_dead_queue_releases_the_waiting_batch_and_later_calls_tell_nothing():
    told = []
    channel = FinishedChannel(StandInQueue())
    call, (teller,) = channel.open(lambda row, record, text: told.append(row), [0])
    teller(0, "record", "a")
    # before the rank closes: its batch must not wait for it
    channel.queue.items.put(DIE)
    # released by the dead queue, not by ALL_TOLD_TIMEOUT_S
    channel.wait(call)
    assert told == [0]
    assert channel.open(lambda *told: None, [0, 4]) == (None, [None, None])
