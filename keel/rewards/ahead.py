"""What a scoring process runs for one sample, and that sample's scoring begun ahead of its batch
(`RewardScorer.start`, as each sample finishes generating)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass

from keel.rewards.choice import REWARD_MODEL
from keel.rewards.contract import verl_extra_info
from keel.rewards.executor import Started
from keel.rewards.worker import SampleTask


def sample_task(record, weights: dict, text: str, timeout_s: float | None) -> SampleTask:
    """What a scoring process runs for one sample: its rule scorers (the reward model runs here)."""
    return SampleTask(
        [(name, spec) for name, (spec, _) in weights.items() if spec != REWARD_MODEL],
        record.data_source,
        text,
        record.ground_truth,
        verl_extra_info(record.extra_info),
        timeout_s,
    )


@dataclass(frozen=True)
class StartedSample:
    """A sample's scoring begun ahead of its batch (`RewardScorer.start`)."""

    # what it scores, pickled: the response, its row's ground truth and extra_info, the scorers
    task: bytes
    started: Started

    @classmethod
    def of_task(cls, task: SampleTask, started: Started | None) -> StartedSample | None:
        """The record of `task`'s scoring begun, or None where the pool began none."""
        return None if started is None else cls(pickle.dumps(task), started)

    def of(self, task: SampleTask) -> Started | None:
        """The scoring begun, if it is `task`'s (a sample whose text or record differs is scored
        again). Compared pickled: a record's numpy arrays (verl's parquet rows) compare elementwise
        otherwise."""
        return self.started if pickle.dumps(task) == self.task else None


def begun(started: StartedSample | None, task: SampleTask) -> Started | None:
    """The scoring `started` began for `task`, or None: none began, or it began another task's."""
    return started and started.of(task)
