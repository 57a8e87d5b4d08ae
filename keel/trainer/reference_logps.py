"""DPO's reference log-probs, from where `dpo.reference` says (`PreferenceConfig.reference`).

- cached: each pair's log-probs computed once, before the first update, by the model training
  starts from (the reference: a fresh run's own policy before its first step), and kept in the
  run directory (`reference_logps.pt`, with a fingerprint of the model's files, the dtype and the
  data): no second model, no reference pass in a step, and a resumed run reads them again. A
  resumed run whose file is gone loads the starting model to redo them, since the trained one has
  moved.
- model: a frozen copy of the starting model, a pass in every step (TRL's default).
- adapter: LoRA's own base with the adapters off, a pass in every step.
- none: a reference-free loss (SimPO).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from keel.algorithms.preference import PairLogProbs
from keel.data.preference import PreferencePair
from keel.training.preference import PairBatch, pair_log_probs

log = logging.getLogger("keel")

CACHE_FILE = "reference_logps.pt"


class NoReference:
    def prepare(self, splits: dict[str, list[PreferencePair]]) -> None:
        return None

    def log_probs(self, split: str, rows: list[int], batch: PairBatch) -> PairLogProbs | None:
        return None


class ModelReference(NoReference):
    """A pass of a frozen model (a copy, or the policy with its adapters off) per micro-batch."""

    def __init__(self, model, adapters_off: bool = False):
        self.model, self.adapters_off = model, adapters_off

    @torch.no_grad()
    def log_probs(self, split: str, rows: list[int], batch: PairBatch) -> PairLogProbs:
        was_training = self.model.training
        self.model.eval()
        try:
            if self.adapters_off:
                with self.model.disable_adapter():
                    return pair_log_probs(self.model, batch)[0]
            return pair_log_probs(self.model, batch)[0]
        finally:
            self.model.train(was_training)


class CachedReference(NoReference):
    """Log-probs per pair, computed once by the starting model and kept in the run directory."""

    def __init__(
        self,
        path: Path,
        identity: str,
        starting_model: Callable[[], object],
        collate: Callable[[list[PreferencePair]], PairBatch],
        micro_batch: int,
        compute_context: Callable,
    ):
        self.path, self.identity = path, identity
        self.starting_model, self.collate = starting_model, collate
        self.micro_batch, self.compute_context = micro_batch, compute_context
        # split -> [pairs, 2] summed log-probs of chosen and rejected
        self.table: dict[str, torch.Tensor] = {}

    def prepare(self, splits: dict[str, list[PreferencePair]]) -> None:
        fingerprint = _fingerprint(self.identity, splits)
        if self.path.is_file():
            saved = torch.load(self.path, weights_only=True)
            if saved.get("fingerprint") == fingerprint:
                self.table = saved["log_probs"]
                log.info("reference log-probs read from %s", self.path)
                return
            log.info("%s is for other data or another model: computing it again", self.path)
        model = self.starting_model()
        with self.compute_context():
            self.table = {
                name: self._compute(model, pairs) for name, pairs in splits.items() if pairs
            }
        tmp = self.path.with_suffix(".tmp")
        torch.save({"fingerprint": fingerprint, "log_probs": self.table}, tmp)
        os.replace(tmp, self.path)
        log.info("reference log-probs of %s pairs kept in %s", _counts(self.table), self.path)

    @torch.no_grad()
    def _compute(self, model, pairs: list[PreferencePair]) -> torch.Tensor:
        was_training = model.training
        model.eval()
        parts = []
        try:
            for start in range(0, len(pairs), self.micro_batch):
                sums = pair_log_probs(model, self.collate(pairs[start : start + self.micro_batch]))[
                    0
                ]
                parts.append(torch.stack([sums.chosen, sums.rejected], dim=1).float().cpu())
        finally:
            model.train(was_training)
        return torch.cat(parts)

    def log_probs(self, split: str, rows: list[int], batch: PairBatch) -> PairLogProbs:
        values = self.table[split][rows]  # [b, 2]
        tokens = batch.completion_tokens
        return PairLogProbs(values[:, 0], values[:, 1], tokens[0::2], tokens[1::2])


def model_identity(m, dtype) -> str:
    """What the reference's log-probs depend on besides the data: the model's (and starting
    adapter's) weight files as they are on disk, and the compute dtype. A model retrained in place
    has other sizes or times, so its old cache is not read."""
    files = []
    for folder in filter(None, (m.path, m.lora_adapter_path)):
        for path in sorted(Path(folder).glob("*.safetensors")) + sorted(Path(folder).glob("*.bin")):
            stat = path.stat()
            files.append(f"{path}:{stat.st_size}:{stat.st_mtime_ns}")
    return "|".join([str(m.path), str(m.lora_adapter_path), str(dtype), *files])


def _fingerprint(identity: str, splits: dict[str, list[PreferencePair]]) -> str:
    digest = hashlib.sha256(identity.encode())
    for name, pairs in sorted(splits.items()):
        digest.update(name.encode())
        for pair in pairs:
            for ids in (pair.prompt_ids, pair.chosen_ids, pair.rejected_ids):
                digest.update(len(ids).to_bytes(4, "little"))
                digest.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
    return digest.hexdigest()


def _counts(table: dict[str, torch.Tensor]) -> str:
    return ", ".join(f"{len(values)} {name}" for name, values in table.items())
