"""The contract every generation engine meets, and the capabilities each one declares: callers read
`engine.capabilities`, never the engine's type or attributes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from keel.types import GeneratedBatch, SamplingParams


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do beyond `generate` and the weight syncs."""

    # generate(prompts, params, on_finished=): told of each sample as it finishes
    streams_finished: bool = False
    # continuous_batcher(sequences, max_len, turn_tokens): the engine service (agent loop, OpenAI
    # endpoint) drives it turn by turn, each sequence keeping its KV cache
    continuous: bool = False
    # generate_round(samples, params, end): partial rollouts end a round part-way
    generate_round: bool = False
    # False: generates with the policy module it was given (the trainer's own, unsharded), so
    # that module stays eager and its weights need no sync
    owns_weights: bool = True
    # load_adapters(adapters): LoRA adapters applied unmerged over a base it holds
    load_adapters: bool = False
    # share_frozen_weights(named): a LoRA trainer's frozen base becomes views of its weights
    shares_frozen_weights: bool = False


class RolloutEngine(Protocol):
    # seconds per part of the last generate call, if the engine times them
    timing: dict[str, float]
    capabilities: Capabilities

    def generate(self, prompts, params: SamplingParams) -> GeneratedBatch:
        """Generate for a PromptBatch whose prompts are already repeated `n` times.

        Returns responses right-padded after EOS, their masks (EOS included) and the log-probs of
        the sampled tokens under the sampling distribution (logits / temperature).
        """

    def sync_weights(self, model) -> None:
        """Make the next `generate` use the current weights of an unsharded policy module."""

    def load_weights(self, named) -> None:
        """The same from (parameter name, whole tensor) pairs: a sharded policy's, gathered."""
