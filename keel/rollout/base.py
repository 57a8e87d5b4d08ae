"""The contract every generation engine meets."""

from __future__ import annotations

from typing import Protocol

from keel.types import GeneratedBatch, SamplingParams


class RolloutEngine(Protocol):
    # seconds per part of the last generate call, if the engine times them
    timing: dict[str, float]

    def generate(self, prompts, params: SamplingParams) -> GeneratedBatch:
        """Generate for a PromptBatch whose prompts are already repeated `n` times.

        Returns responses right-padded after EOS, their masks (EOS included) and the log-probs of
        the sampled tokens under the sampling distribution (logits / temperature).
        """

    def sync_weights(self, model) -> None:
        """Make the next `generate` use the current weights of an unsharded policy module."""

    def load_weights(self, named) -> None:
        """The same from (parameter name, whole tensor) pairs: a sharded policy's, gathered."""
