"""keel's rollout engine for Qwen2 and Llama: prefill once per prompt, a static KV cache, decode
steps with fused projections, CUDA graphs on GPU, sampling on the device.

Its parts: the weights (weights.py: one copy, fused projections in the compute dtype, filled from
the policy's parameters after every update), the layer math (layers.py), the decode state, kept
cache and captured graphs (state.py), decode attention (attention.py) and sampling (sampling.py).
This module is the loop: cut the prompts into chunks that fit memory, prefill, decode, assemble.

Prefill (compute-bound: plain matmuls and SDPA) runs eagerly over the same weights, once per
distinct prompt, writing its KV into every slot of the prompt's group. Decoding, the memory-bound
part, attends over the static cache. On a GPU the step's elementwise work is fused by
torch.compile, and the step is captured as a CUDA graph and replayed: one launch per token instead
of hundreds from Python.

Fixed lengths (ignore_eos) decode a whole chunk to the end here. Lengths that vary (EOS on, and
multi-turn) go through continuous batching (batching.py), where finished rows are refilled.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from keel.rollout.assemble import assemble_batch, stop_token_ids
from keel.rollout.native.batching import ContinuousBatcher
from keel.rollout.native.layers import StepFunctions, grouped_attention, prompt_visibility, within_window
from keel.rollout.native.models import unsupported_reason
from keel.rollout.native.runner import ModelRunner
from keel.rollout.native.state import Clock, DecodeGraph, DecodeState, KeptCache
from keel.types import RolloutBatch, SamplingParams

log = logging.getLogger("keel")

__all__ = ["NativeRolloutEngine", "unsupported_reason"]

# free_cache_engine unset: a cache this small a share of the GPU stays. Capturing again costs every
# step: 0.05 s of t1's on Qwen2.5-0.5B, 0.30 s of 1.83 on Qwen3-0.6B, whose t1 cache is 5.3% of an H200.
KEEP_CACHE_SHARE = 0.08


def keeps_cache(free_cache_engine: bool | None, cache_bytes: int, device_bytes: int) -> bool:
    """free_cache_engine as set, or unset: keep a cache within KEEP_CACHE_SHARE of the device's
    memory (none on CPU, where there are no graphs to keep)."""
    if free_cache_engine is not None:
        return not free_cache_engine
    return cache_bytes <= KEEP_CACHE_SHARE * device_bytes


class NativeRolloutEngine:
    def __init__(self, model, tokenizer, max_num_seqs: int, dtype: torch.dtype, enforce_eager: bool = False,
                 memory_utilization: float = 0.5, max_num_batched_tokens: int = 8192, compile_step: bool = True,
                 free_cache_engine: bool | None = None, compile_mode: str | None = None):
        self.tokenizer = tokenizer
        # free_cache_engine=False (verl's key): the KV cache and its CUDA graphs stay between calls
        # and are reused when a chunk has the same shape, as fixed-length batches do. None: kept
        # when small (keeps_cache), since capturing the graphs again costs every step.
        self.free_cache_engine = free_cache_engine
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.memory_utilization = memory_utilization
        self.dtype = dtype
        self.eos_ids = stop_token_ids(tokenizer, model)
        self.timing: dict[str, float] = {}  # seconds per part (prefill, capture, decode) of the last call
        self.runner = ModelRunner(model, dtype, tokenizer.pad_token_id, enforce_eager, compile_step, compile_mode)
        self.family, self.weights, self.device = self.runner.family, self.runner.weights, self.runner.device
        self.layers, self.use_cuda_graphs = self.weights.layers, self.runner.use_cuda_graphs
        self.eos = torch.tensor(self.eos_ids, device=self.device)
        self._kept: KeptCache | None = None
        self._kept_batcher: ContinuousBatcher | None = None

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

    def share_frozen_weights(self, named: Iterable[tuple[str, Tensor]]) -> int:
        """LoRA: the trainer's frozen base parameters become views of the decode weights (one copy
        of the base on the device). -> bytes freed."""
        return self.weights.alias(named)

    def load_adapters(self, adapters: Iterable[tuple[str, Tensor, Tensor]]) -> None:
        """LoRA: the adapters, (weight name, A, B times scaling), applied unmerged in the step."""
        self.weights.load_adapters(adapters)

    # --- generation ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts, params: SamplingParams) -> RolloutBatch:
        self.timing.clear()
        if not params.ignore_eos:  # lengths vary: rows that finish are refilled
            return self._generate_continuously(prompts, params)
        size = self._sequences_at_once(prompts.input_ids.shape[1] + params.max_new_tokens)
        parts = [self._generate_chunk(prompts.input_ids[i:i + size], prompts.attention_mask[i:i + size],
                                      [r.index for r in prompts.records[i:i + size]], params)
                 for i in range(0, len(prompts), size)]
        return assemble_batch(prompts, parts, self.tokenizer, self.eos_ids, params)

    def _generate_continuously(self, prompts, params: SamplingParams) -> RolloutBatch:
        batcher = self.continuous_batcher(len(prompts), prompts.input_ids.shape[1] + params.max_new_tokens,
                                          params.max_new_tokens)
        for i, (ids, mask, record) in enumerate(zip(prompts.input_ids, prompts.attention_mask, prompts.records)):
            batcher.add(i, ids[mask.bool()].tolist(), params.max_new_tokens, group=record.index)
        turns = [None] * len(prompts)
        while batcher.busy:
            for turn in batcher.step(params):
                turns[turn.key] = turn
                batcher.release(turn.key)
        ids = pad_sequence([torch.tensor(t.ids) for t in turns], batch_first=True,
                           padding_value=self.tokenizer.pad_token_id)
        log_probs = pad_sequence([torch.tensor(t.log_probs) for t in turns], batch_first=True)
        return assemble_batch(prompts, [(ids, log_probs)], self.tokenizer, self.eos_ids, params)

    @torch.no_grad()
    def continuous_batcher(self, sequences: int, max_len: int, turn_tokens: int) -> ContinuousBatcher:
        """Rows for up to `sequences` sequences of at most `max_len` tokens (as many as fit memory),
        a turn taking at most `turn_tokens`; kept between calls with free_cache_engine=False."""
        rows = min(sequences, self._sequences_at_once(max_len))
        self.timing.clear()  # the batcher's steps add theirs
        kept = self._kept_batcher
        if kept is not None and all(have >= want for have, want in zip(kept.shape, (rows, max_len, turn_tokens))):
            kept.reset()  # big enough: its rows, graphs and all
            return kept
        self._kept = self._kept_batcher = None  # one kept cache: a new one's memory comes first
        batcher = ContinuousBatcher(self.runner, self.eos, (rows, max_len, turn_tokens), self.max_num_batched_tokens,
                                    self.timing)
        if self._keeps(batcher.state):
            self._kept_batcher = batcher
        return batcher

    def _keeps(self, state) -> bool:
        """Whether a new chunk's state is kept for the next call (free_cache_engine)."""
        total = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else 0
        return keeps_cache(self.free_cache_engine, sum(t.nbytes for t in state.k + state.v), total)

    def _sequences_at_once(self, seq_len: int) -> int:
        """rollout.max_num_seqs, fewer if their KV cache would pass gpu_memory_utilization of the
        memory available: free on the device, cached by torch's allocator but unused (training
        leaves much there), and the cache this engine keeps (free_cache_engine=False), which a
        chunk of another shape replaces."""
        if self.device.type != "cuda":
            return self.max_num_seqs
        free, _ = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        for kept in (self._kept and self._kept.state, self._kept_batcher and self._kept_batcher.state):
            free += sum(t.nbytes for t in kept.k + kept.v) if kept else 0
        per_sequence = self.runner.cache_bytes_per_token() * seq_len
        fits = max(1, int(free * self.memory_utilization // per_sequence))
        if fits < self.max_num_seqs:
            log.info("native rollout: %d sequences at once (KV cache within %.0f%% of %.1f GB free)", fits,
                     100 * self.memory_utilization, free / 1e9)
        return min(self.max_num_seqs, fits)

    def _generate_chunk(self, input_ids: Tensor, attention_mask: Tensor, groups: list[int],
                        params: SamplingParams) -> tuple[Tensor, Tensor]:
        batch, prompt_len = input_ids.shape
        steps = params.max_new_tokens
        # One prefill per distinct prompt: consecutive rows of the same group share it.
        groups_t = torch.tensor(groups)
        first = torch.ones(batch, dtype=torch.bool)
        first[1:] = groups_t[1:] != groups_t[:-1]
        slot_to_prompt = (first.long().cumsum(0) - 1).to(self.device)                    # [B]
        clock = Clock(self.device)
        state = self._chunk_state(batch, prompt_len, steps)
        state.pad.copy_((attention_mask == 0).sum(-1).to(self.device))
        prompt_logits = self._prefill(input_ids[first].to(self.device), attention_mask[first].to(self.device),
                                      slot_to_prompt, state)
        token, log_prob = self.runner.sample(prompt_logits[slot_to_prompt], params)
        state.record(token, log_prob, self.eos, params.ignore_eos)
        clock.lap("prefill")
        step = self._chunk_step_fn(state, params)
        clock.lap("capture")
        for _ in range(1, steps):  # fixed lengths (ignore_eos): every row decodes to the end
            step()
        clock.lap("decode")
        for part, seconds in clock.laps.items():
            self.timing[part] = self.timing.get(part, 0.0) + seconds
        return state.tokens.cpu(), state.log_probs.float().cpu()

    def _chunk_state(self, batch: int, prompt_len: int, steps: int) -> DecodeState:
        """A new decode state for a chunk or, keeping the cache, the kept one when the shape matches
        (no need to clear its KV: every column a step reads was written in this call)."""
        shape = (batch, prompt_len, steps)
        if self._kept is not None and self._kept.shape == shape:
            self._kept.state.reset(self.tokenizer.pad_token_id)
            return self._kept.state
        self._kept = self._kept_batcher = None  # a kept cache goes before the new one is allocated
        state = DecodeState.allocate(batch, prompt_len, steps, layers=len(self.layers), kv_heads=self.runner.kv_heads,
                                     head_dim=self.runner.head_dim, dtype=self.dtype, device=self.device,
                                     pad_token_id=self.tokenizer.pad_token_id)
        if self._keeps(state):
            self._kept = KeptCache(shape, state)
        return state

    def _chunk_step_fn(self, state: DecodeState, params: SamplingParams):
        """The decode step of a chunk: the kept graph when the state and sampling are the same."""
        kept = self._kept
        if kept is None or kept.state is not state:
            return self._decode_step_fn(state, params)
        if kept.params != params:  # sampling settings are constants in the captured graph
            kept.params, kept.step = params, self._decode_step_fn(state, params)
        return kept.step

    def _prefill(self, input_ids: Tensor, attention_mask: Tensor, slot_to_prompt: Tensor,
                 state: DecodeState) -> Tensor:
        """A forward over the distinct prompts, at most max_num_batched_tokens prompt tokens per
        pass; each prompt's KV goes to every slot of its group. -> [U, V] logits."""
        per_pass = max(1, self.max_num_batched_tokens // input_ids.shape[1])
        w = self.weights
        logits = []
        for start in range(0, input_ids.shape[0], per_pass):
            ids, mask = input_ids[start:start + per_pass], attention_mask[start:start + per_pass]
            slots = ((slot_to_prompt >= start) & (slot_to_prompt < start + len(ids))).nonzero().squeeze(-1)
            hidden = self._prompt_forward(ids, mask, state, slots, slot_to_prompt[slots] - start)
            logits.append(F.linear(hidden, w.lm_head))  # already normed
        return torch.cat(logits)

    def _prompt_forward(self, ids: Tensor, mask: Tensor, state: DecodeState, slots: Tensor,
                        prompt_of_slot: Tensor) -> Tensor:
        """The last position's normed hidden state [u, H] of left-padded prompts [u, P], their K
        and V written to the cache rows `slots` (prompt_of_slot: each slot's row of `ids`). A pass
        takes at most max_num_batched_tokens tokens: a longer prompt goes in pieces, each
        attending to the cache the earlier ones wrote (chunked prefill)."""
        u, prompt_len = ids.shape
        w = self.weights
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        first_slots = slots[torch.searchsorted(prompt_of_slot, torch.arange(u, device=ids.device))]
        piece = max(1, self.max_num_batched_tokens // u)
        unpadded = bool(mask.all())  # one host sync per pass
        for begin in range(0, prompt_len, piece):
            end = min(begin + piece, prompt_len)
            x = F.embedding(ids[:, begin:end], w.embed).flatten(0, 1) * self.family.embed_scale  # [N, H]
            # No mask where plain causal attention is right: SDPA may then use its flash kernel,
            # and no [u, L, end] mask is built.
            visible = None if unpadded and begin == 0 else prompt_visibility(mask[:, :end].bool(), begin)
            queries = torch.arange(begin, end, device=ids.device)

            def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
                q, k, v = (t.view(u, end - begin, t.shape[1], t.shape[-1]).transpose(1, 2) for t in (q, k, v))
                state.k[i][slots, :, begin:end] = k[prompt_of_slot]
                state.v[i][slots, :, begin:end] = v[prompt_of_slot]
                if begin > 0:  # earlier pieces' K/V too, as the cache holds them
                    k, v = state.k[i][first_slots, :, :end], state.v[i][first_slots, :, :end]
                seen = within_window(visible, queries, end, self.family.window(i))
                attention = grouped_attention(q, k, v, seen)                                    # [u, H, L, D]
                return attention.transpose(1, 2).reshape(x.shape[0], -1)                        # [N, H * D]

            h = self.family.layers(self.runner.eager, w, x, positions[:, begin:end].flatten(), attend)
        return h.view(u, end - begin, -1)[:, -1]

    def _decode_step_fn(self, state: DecodeState, params: SamplingParams):
        """One decode step as a callable: a CUDA graph replay on GPU, the eager step elsewhere."""
        def eager() -> None:
            logits = self.runner.decode_logits(state.last_token, state.pad, state.prompt_len + state.step - 1, state.k,
                                               state.v)
            token, log_prob = self.runner.sample(logits, params)
            state.record(token, log_prob, self.eos, params.ignore_eos)

        if not self.use_cuda_graphs:
            return eager
        # A graph replays on the addresses it was captured with: captured per chunk, unless the
        # cache is kept (free_cache_engine=False) and reused with the same state.
        return DecodeGraph(eager, state).replay
