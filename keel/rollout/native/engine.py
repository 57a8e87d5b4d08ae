"""keel's rollout engine: one engine for every family in models/, in nano-vllm's shape.

Its parts: the model runner (runner.py: the weights, one copy with fused projections in the
compute dtype, filled from the policy's parameters after every update; the family's layer math;
the compiled step functions; the decode attention kernel; one prefill pass and one decode step),
the scheduler (scheduler.py, no tensors: which sequence holds which row of the KV cache, refills,
turns, budgets, prefill packing), the rows' device state (decode_state.py: the cache, each turn's
tokens, a CUDA graph per batch bucket), the batcher that steps one with the other (batching.py)
and this module: the engine's public face (generate, the batcher the agent loop drives through the
engine service, weight sync and LoRA, the capabilities it declares), and how much of the GPU its
cache may take and keep.

Every generation goes through the scheduler: fixed lengths (ignore_eos) and varying ones, single
turns and multi-turn episodes. Prefill (compute-bound: plain matmuls and SDPA) runs eagerly over
the same weights, once per distinct prompt of a group. Decoding, the memory-bound part, attends
over the static cache; on a GPU the step's elementwise work is fused by torch.compile, and the
step is captured as a CUDA graph and replayed: one launch per token instead of hundreds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import Tensor

from keel.rollout.assemble import assemble_batch, padded_rows, stop_token_ids, unpadded_rows
from keel.rollout.base import Capabilities
from keel.rollout.native.batching import ContinuousBatcher, drive
from keel.rollout.native.layers import StepFunctions
from keel.rollout.native.models import unsupported_reason
from keel.rollout.native.runner import ModelRunner
from keel.types import GeneratedBatch, PartialSample, RoundEnd, SamplingParams

log = logging.getLogger("keel")

__all__ = ["NativeRolloutEngine", "unsupported_reason"]

# free_cache_engine unset: a cache this small a share of the GPU stays. Capturing again costs every
# step: 0.05 s of t1's on Qwen2.5-0.5B, 0.064 s of 1.82 on Qwen3-0.6B on an H100.
KEEP_CACHE_SHARE = 0.08
# Once a step has trained, torch's allocator holds what that step needed (memory freed stays
# reserved, and nothing here empties it): a larger cache stays too where it fits beside that
# within this share of the GPU. Qwen3-0.6B's t1 cache is 9.4% of an H100.
KEEP_CACHE_ROOM = 0.9


def keeps_cache(
    free_cache_engine: bool | None,
    cache_bytes: int,
    device_bytes: int,
    step_reserved: int | None = None,
) -> bool:
    """free_cache_engine as set, or unset: keep a cache within KEEP_CACHE_SHARE of the device's
    memory, or one that fits within KEEP_CACHE_ROOM beside `step_reserved`, the bytes torch's
    allocator held after a trained step (None before one). None on CPU, where there are no graphs
    to keep."""
    if free_cache_engine is not None:
        return not free_cache_engine
    if cache_bytes <= KEEP_CACHE_SHARE * device_bytes:
        return True
    return (
        step_reserved is not None and step_reserved + cache_bytes <= KEEP_CACHE_ROOM * device_bytes
    )


class NativeRolloutEngine:
    capabilities = Capabilities(
        streams_finished=True,
        continuous=True,
        generate_round=True,
        owns_weights=True,
        load_adapters=True,
        shares_frozen_weights=True,
    )

    def __init__(
        self,
        model,
        tokenizer,
        max_num_seqs: int,
        dtype: torch.dtype,
        enforce_eager: bool = False,
        memory_utilization: float = 0.5,
        max_num_batched_tokens: int = 8192,
        compile_step: bool = True,
        free_cache_engine: bool | None = None,
        compile_mode: str | None = None,
        batch_invariant: bool = False,
    ):
        self.tokenizer = tokenizer
        # free_cache_engine=False (verl's key): the KV cache and its CUDA graphs stay between calls
        # and are reused when the next call fits them, as fixed-length batches do. None: kept
        # when small (keeps_cache), since capturing the graphs again costs every step.
        self.free_cache_engine = free_cache_engine
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.memory_utilization = memory_utilization
        self.dtype = dtype
        self.eos_ids = stop_token_ids(tokenizer, model)
        # seconds per part (prefill, capture, decode) of the last call
        self.timing: dict[str, float] = {}
        self.runner = ModelRunner(
            model,
            dtype,
            tokenizer.pad_token_id,
            enforce_eager,
            compile_step,
            compile_mode,
            batch_invariant,
        )
        self.family, self.weights, self.device = (
            self.runner.family,
            self.runner.weights,
            self.runner.device,
        )
        self.layers = self.weights.layers
        self.eos = torch.tensor(self.eos_ids, device=self.device)
        self._kept_batcher: ContinuousBatcher | None = None
        # whether weights came after a generation: a step has trained, and the allocator holds
        # what it needed
        self._generated = self._trained = False

    @property
    def kernels(self) -> StepFunctions:
        """The decode step's functions (the runner's; a test or benchmark may swap them)."""
        return self.runner.kernels

    @kernels.setter
    def kernels(self, functions: StepFunctions) -> None:
        self.runner.kernels = functions

    @property
    def attention(self):
        return self.runner.attention

    @attention.setter
    def attention(self, kernel) -> None:
        self.runner.attention = kernel

    # --- weights ---------------------------------------------------------------------------------
    def sync_weights(self, model) -> None:
        """The next generate uses the module's current weights (an unsharded policy's own)."""
        self.load_weights(model.named_parameters())

    def load_weights(self, named: Iterable[tuple[str, Tensor]], every: bool = True) -> None:
        """The same from (parameter name, whole tensor) pairs: every parameter the engine uses, or
        (every=False) only those that changed."""
        self.runner.load_weights(named, every)
        self._trained = self._trained or self._generated

    def share_frozen_weights(self, named: Iterable[tuple[str, Tensor]]) -> int:
        """LoRA: the trainer's frozen base parameters become views of the decode weights (one copy
        of the base on the device). -> bytes freed."""
        return self.weights.alias(named)

    def load_adapters(self, adapters: Iterable[tuple[str, Tensor, Tensor]]) -> None:
        """LoRA: the adapters, (weight name, A, B times scaling), applied unmerged in the step."""
        self.weights.load_adapters(adapters)

    # --- generation ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts, params: SamplingParams, on_finished=None) -> GeneratedBatch:
        """Every prompt's samples, through the scheduler: rows that finish are refilled.
        `on_finished(row, record, response text)` is called as each sample finishes, while others
        generate (its reward can be scored meanwhile)."""
        batcher = self.continuous_batcher(
            len(prompts), prompts.input_ids.shape[1] + params.max_new_tokens, params.max_new_tokens
        )
        contexts = unpadded_rows(prompts.input_ids, prompts.attention_mask)
        for i, (context, record) in enumerate(zip(contexts, prompts.records)):
            batcher.add(i, context, params.max_new_tokens, group=record.index)
        turns, texts = [None] * len(prompts), [None] * len(prompts)
        for turn in drive(batcher, params):
            turns[turn.key] = turn
            if on_finished is not None:
                # a turn's ids end at its stop token: the masked response's text
                texts[turn.key] = self.tokenizer.decode(turn.ids, skip_special_tokens=True)
                on_finished(turn.key, prompts.records[turn.key], texts[turn.key])
        ids = padded_rows([t.ids for t in turns], self.tokenizer.pad_token_id, torch.long)
        log_probs = padded_rows([t.log_probs for t in turns], 0.0, torch.float32)
        chunks = [(ids, log_probs)]
        return assemble_batch(prompts, chunks, self.tokenizer, self.eos_ids, params, texts)

    @torch.no_grad()
    def generate_round(
        self, samples: list[PartialSample], params: SamplingParams, end: RoundEnd
    ) -> list[tuple[list[int], list[float], bool, bool]]:
        """Partial rollouts: the unfinished `samples` go on (each from its prompt and the tokens it
        has) until `end` is reached -> per sample, (the tokens sampled now, their log-probs, whether
        it finished, whether it ended at the response length without a stop token). A continued
        sample's context is prefilled again: its cached keys were the older policy's."""
        longest = max(len(s.record.prompt_ids) for s in samples)
        batcher = self.continuous_batcher(
            len(samples), longest + params.max_new_tokens, params.max_new_tokens
        )
        sampled = [([], [], s.finished, s.truncated) for s in samples]
        for i, s in enumerate(samples):
            # the fresh samples of a prompt share its prefill
            if not s.finished:
                context, left = s.record.prompt_ids + s.ids, params.max_new_tokens - len(s.ids)
                batcher.add(i, context, left, group=None if s.ids else s.group)
        groups = [s.group for s in samples]
        stops = set() if params.ignore_eos else set(self.eos_ids)

        def round_ended() -> bool:
            return end.reached(groups, [done for _, _, done, _ in sampled])

        for turn in drive(batcher, params, until=round_ended):
            sampled[turn.key] = (turn.ids, turn.log_probs, True, turn.ids[-1] not in stops)
        for turn in batcher.cut():
            sampled[turn.key] = (turn.ids, turn.log_probs, False, False)
            batcher.release(turn.key)
        return sampled

    @torch.no_grad()
    def continuous_batcher(
        self, sequences: int, max_len: int, turn_tokens: int
    ) -> ContinuousBatcher:
        """Rows for up to `sequences` sequences of at most `max_len` tokens (as many as fit memory),
        a turn taking at most `turn_tokens`; kept between calls with free_cache_engine=False."""
        rows = min(sequences, self._sequences_at_once(max_len))
        # the batcher's steps add theirs
        self.timing.clear()
        self._generated = True
        kept = self._kept_batcher
        if kept is not None and all(
            have >= want for have, want in zip(kept.shape, (rows, max_len, turn_tokens))
        ):
            # big enough: its rows, graphs and all
            kept.reset()
            return kept
        # one kept cache: a new one's memory comes first
        self._kept_batcher = None
        step_reserved = memory_reserved(self.device) if self._trained else None
        batcher = ContinuousBatcher(
            self.runner,
            self.eos,
            (rows, max_len, turn_tokens),
            self.max_num_batched_tokens,
            self.timing,
        )
        cache = batcher.decoding.cache_bytes()
        if keeps_cache(self.free_cache_engine, cache, device_memory(self.device), step_reserved):
            self._kept_batcher = batcher
        return batcher

    @property
    def keeps_cache_now(self) -> bool:
        """Whether the last call's KV cache and graphs stay for the next (free_cache_engine)."""
        return self._kept_batcher is not None

    def _sequences_at_once(self, seq_len: int) -> int:
        """rollout.max_num_seqs, fewer if their KV cache would not fit (sequences_that_fit), the
        cache this engine keeps counted as free: a scheduler too small for the call replaces it."""
        kept = self._kept_batcher
        return sequences_that_fit(
            self.device,
            kept.decoding.cache_bytes() if kept is not None else 0,
            self.runner.cache_bytes_per_token() * seq_len,
            self.memory_utilization,
            self.max_num_seqs,
        )


def device_memory(device: torch.device) -> int:
    """The device's memory in bytes (0 on CPU, where there are no graphs to keep)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).total_memory


def memory_reserved(device: torch.device) -> int:
    """What torch's allocator holds on the device (0 on CPU)."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def sequences_that_fit(
    device: torch.device, kept_bytes: int, per_sequence: int, utilization: float, most: int
) -> int:
    """`most` sequences, fewer if their KV cache (`per_sequence` bytes each) would pass
    gpu_memory_utilization of the memory available: free on the device, cached by torch's allocator
    but unused (training leaves much there), and `kept_bytes` of a kept cache."""
    if device.type != "cuda":
        return most
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) + kept_bytes
    fits = max(1, int(free * utilization // per_sequence))
    if fits < most:
        log.info(
            "native rollout: %d sequences at once (KV cache within %.0f%% of %.1f GB free)",
            fits,
            100 * utilization,
            free / 1e9,
        )
    return min(most, fits)
