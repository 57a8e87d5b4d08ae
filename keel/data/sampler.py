"""A sampler of dataset indices that resumes exactly from a checkpoint.

The order of epoch e is a pure function of (seed, e), so the sampler's whole state is two
integers: which epoch, and how many batches of it were taken.
"""

from __future__ import annotations

import numpy as np


class ResumableSampler:
    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        if dataset_size < 1 or batch_size < 1:
            raise ValueError(
                f"dataset_size ({dataset_size}) and batch_size ({batch_size}) must be at least 1"
            )
        if drop_last and batch_size > dataset_size:
            raise ValueError(
                f"batch_size {batch_size} is larger than the dataset "
                f"({dataset_size} prompts), so not one full batch fits"
            )
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self._epoch = 0
        self._position = 0
        self._order = self._epoch_order(0)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        """Batches taken in the current epoch."""
        return self._position

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.dataset_size, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def next_batch(self) -> list[int]:
        if self._position == self.batches_per_epoch:
            self._start_epoch(self._epoch + 1, position=0)
        start = self._position * self.batch_size
        self._position += 1
        return self._order[start : start + self.batch_size].tolist()

    def state_dict(self) -> dict:
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "dataset_size": self.dataset_size,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict) -> None:
        for key, what in (("dataset_size", "dataset size"), ("batch_size", "batch size")):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the {what} changed since the checkpoint "
                    f"({state[key]} then, {getattr(self, key)} now); resuming would "
                    "not see the same batches"
                )
        if not 0 <= state["position"] <= self.batches_per_epoch:
            raise ValueError(
                f"checkpoint position {state['position']} is outside an epoch of "
                f"{self.batches_per_epoch} batches"
            )
        # The checkpoint's seed wins: the batches already trained on came from its order.
        self.seed = state["seed"]
        self._start_epoch(state["epoch"], state["position"])

    def _start_epoch(self, epoch: int, position: int) -> None:
        self._epoch = epoch
        self._position = position
        self._order = self._epoch_order(epoch)

    def _epoch_order(self, epoch: int) -> np.ndarray:  # [dataset_size]
        if not self.shuffle:
            return np.arange(self.dataset_size)
        # Seeding with the pair (seed, epoch), not seed + epoch, keeps run seed=1 from replaying
        # the epoch-1 order of run seed=0.
        return np.random.default_rng((self.seed, epoch)).permutation(self.dataset_size)
