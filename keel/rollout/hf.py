"""Rollout with transformers' `generate`: runs anywhere, shares the policy's weights."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor
from transformers import GenerationConfig, LogitsProcessor

from keel.models.load import autocast
from keel.rollout.assemble import assemble_batch, stop_token_ids
from keel.rollout.base import Capabilities
from keel.types import GeneratedBatch, SamplingParams


@contextmanager
def _neutral_generation_config(model):
    """transformers fills every unset sampling field from the checkpoint's generation_config.json
    (Instruct models ship repetition penalties, suppressed tokens, ...), which would make rollouts
    silently off-policy: generate with only the settings keel passes."""
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


class HFRolloutEngine:
    """Generates with the actor module itself, so it always sees the latest weights."""

    def __init__(
        self,
        model,
        tokenizer,
        max_num_seqs: int = 256,
        dtype: torch.dtype = torch.float32,
        owns_weights: bool = False,
    ):
        """`owns_weights`: `model` is a copy of its own (the policy is sharded), not the policy's
        module."""
        self.model = model
        # generate alone: no streaming, no turns, no rounds, no adapters of its own
        self.capabilities = Capabilities(owns_weights=owns_weights)
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        # compute dtype: bf16 runs under autocast over the float32 weights
        self.dtype = dtype
        # transformers' generate is not broken down
        self.timing: dict[str, float] = {}
        self.eos_ids = stop_token_ids(tokenizer, model)

    def sync_weights(self, model) -> None:
        # same object as the actor's: nothing to copy
        self.model = model

    @torch.no_grad()
    def load_weights(self, named) -> None:
        """Whole parameters by name into this engine's own copy (the actor is sharded)."""
        mine = dict(self.model.named_parameters())
        given = set()
        for name, tensor in named:
            mine[name].copy_(tensor)
            given.add(name)
        # a caller bug: generation would mix stale weights with new
        if given != set(mine):
            raise RuntimeError(f"hf rollout: no weights given for {sorted(set(mine) - given)[:3]}")

    @torch.no_grad()
    def generate(self, prompts, params: SamplingParams) -> GeneratedBatch:
        was_training = self.model.training
        self.model.eval()
        try:
            chunks = [
                self._generate_chunk(
                    prompts.input_ids[i : i + self.max_num_seqs],
                    prompts.attention_mask[i : i + self.max_num_seqs],
                    params,
                )
                for i in range(0, len(prompts), self.max_num_seqs)
            ]
        finally:
            self.model.train(was_training)
        return assemble_batch(prompts, chunks, self.tokenizer, self.eos_ids, params)

    def _generate_chunk(
        self, input_ids: Tensor, attention_mask: Tensor, params: SamplingParams
    ) -> tuple[Tensor, Tensor]:
        device = next(self.model.parameters()).device
        # temperature 0 means greedy
        greedy = not params.do_sample or params.temperature == 0
        gen_config = GenerationConfig(
            do_sample=not greedy,
            temperature=1.0 if greedy else params.temperature,
            top_p=params.top_p,
            # 0 switches top-k off in transformers
            top_k=params.top_k if params.top_k > 0 else 0,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=None if params.ignore_eos else self.eos_ids,
            pad_token_id=self.tokenizer.pad_token_id,
            use_cache=True,
        )
        # Raw logits scaled by temperature: the distribution the trainer recomputes, so the
        # sampler/trainer log-prob gap measures numerics, not top-p/top-k truncation.
        recorder = _SampledLogProbs(1.0 if greedy else params.temperature)
        with _neutral_generation_config(self.model), autocast(device, self.dtype):
            sequences = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=gen_config,
                logits_processor=[recorder],
            )
        # [B, R] x2
        return sequences[:, input_ids.shape[1] :].cpu(), recorder.finish(sequences).cpu()


class _SampledLogProbs(LogitsProcessor):
    """Log-prob of each sampled token, without keeping the [B, R, V] logits of the whole rollout.

    Custom processors run before transformers' sampling warpers, so they see the raw logits. At
    step t the processor keeps that step's log-softmax [B, V]; at step t + 1 the token sampled from
    it is the last column of `input_ids`, and only its log-prob is kept.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.pending: Tensor | None = None  # [B, V]
        # R x [B]
        self.picked: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        self._collect(input_ids)
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _collect(self, input_ids: Tensor) -> None:
        if self.pending is not None:
            self.picked.append(self.pending.gather(-1, input_ids[:, -1:]).squeeze(-1))

    # -> [B, R]
    def finish(self, sequences: Tensor) -> Tensor:
        # the token sampled at the last step
        self._collect(sequences)
        self.pending = None
        return torch.stack(self.picked, dim=1)
