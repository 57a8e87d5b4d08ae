"""The reference policy: the frozen starting model that KL terms are measured against."""

from __future__ import annotations

import torch

from keel.training.batching import MicroBatching
from keel.training.forward import batched_log_probs
from keel.training.placement import SINGLE, Placement
from keel.types import TrainBatch


class ReferencePolicy:
    def __init__(
        self, model, batching: MicroBatching, temperature: float, placement: Placement = SINGLE
    ):
        self.model = model.eval().requires_grad_(False)
        self.placement = placement
        self.batching = batching
        # the actor's, so KL compares the same distributions
        self.temperature = temperature

    def compute_log_probs(self, batch: TrainBatch) -> torch.Tensor:  # [N, R]
        return batched_log_probs(self.model, batch, self.batching, self.temperature, self.placement)


class AdapterlessReference:
    """LoRA's reference: the actor's own base, its adapters switched off for the pass, so no
    second model is held (the base never trains)."""

    def __init__(
        self, peft_model, batching: MicroBatching, temperature: float, placement: Placement = SINGLE
    ):
        self.model, self.batching, self.temperature, self.placement = (
            peft_model,
            batching,
            temperature,
            placement,
        )

    def compute_log_probs(self, batch: TrainBatch) -> torch.Tensor:  # [N, R]
        with self.model.disable_adapter():
            return batched_log_probs(
                self.model, batch, self.batching, self.temperature, self.placement
            )
