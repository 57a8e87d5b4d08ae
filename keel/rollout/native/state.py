"""A generation chunk's device state: the static KV cache and per-row buffers a CUDA graph replays
on, the cache kept between calls (free_cache_engine=False), the captured step, and the clock that
times each part of a call."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from keel.types import SamplingParams


@dataclass
class DecodeState:
    """Static buffers of one generation chunk (CUDA graphs replay on fixed addresses)."""
    k: list[Tensor]            # per layer [B, KV, P + R, D]
    v: list[Tensor]
    tokens: Tensor             # [B, R] sampled tokens
    log_probs: Tensor          # [B, R]
    last_token: Tensor         # [B]
    done: Tensor               # [B] bool
    pad: Tensor                # [B] left-padding columns of each prompt
    step: Tensor               # [1] tokens sampled so far
    prompt_len: int

    @classmethod
    def allocate(cls, batch: int, prompt_len: int, steps: int, *, layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, pad_token_id: int) -> "DecodeState":
        dev = device
        shape = (batch, kv_heads, prompt_len + steps, head_dim)
        return cls(k=[torch.zeros(shape, device=dev, dtype=dtype) for _ in range(layers)],
                   v=[torch.zeros(shape, device=dev, dtype=dtype) for _ in range(layers)],
                   tokens=torch.full((batch, steps), pad_token_id, dtype=torch.long, device=dev),
                   log_probs=torch.zeros((batch, steps), device=dev), last_token=torch.zeros(batch, dtype=torch.long,
                                                                                          device=dev),
                   done=torch.zeros(batch, dtype=torch.bool, device=dev), pad=torch.zeros(batch, dtype=torch.long,
                                                                                         device=dev),
                   step=torch.zeros(1, dtype=torch.long, device=dev), prompt_len=prompt_len)

    def reset(self, pad_token_id: int) -> None:
        """Ready for a new chunk of the same shape (the caller sets `pad`)."""
        self.tokens.fill_(pad_token_id)
        self.log_probs.zero_()
        self.last_token.zero_()
        self.done.zero_()
        self.step.zero_()

    def record(self, token: Tensor, log_prob: Tensor, eos: Tensor, ignore_eos: bool) -> None:
        """Write this step's token and advance, on the device (what follows an EOS is masked later)."""
        index = self.step.expand(token.shape[0]).unsqueeze(-1)
        self.tokens.scatter_(1, index, token.unsqueeze(-1))
        self.log_probs.scatter_(1, index, log_prob.unsqueeze(-1))
        if not ignore_eos:
            self.done |= torch.isin(token, eos)
        self.last_token.copy_(token)
        self.step += 1


@dataclass
class KeptCache:
    """free_cache_engine=False: the last chunk's state (KV cache) and its captured step."""
    shape: tuple[int, int, int]  # batch, prompt length, steps
    state: DecodeState
    params: SamplingParams | None = None
    step: object = None



def capture(step_fn, pool=None) -> torch.cuda.CUDAGraph:
    """`step_fn` captured as a CUDA graph (run once on a side stream first, as capture requires:
    allocator and kernel selection). The warm-up's effects are the caller's to undo."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step_fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: a tool or environment running on another thread (the agent loop overlaps them
    # with decoding) may use CUDA while a bucket's graph is captured.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # recorded, not run
        step_fn()
    return graph


class DecodeGraph:
    """A decode step captured once and replayed."""

    def __init__(self, step_fn, state: DecodeState):
        self.state = state  # the graph reads and writes its buffers: they live as long as it does
        # The warm-up runs the step, so its outputs are put back afterwards. The KV cache is not:
        # the step writes only the current column, from the current token, and the first replay
        # writes the same values there again.
        saved = (state.step.clone(), state.tokens.clone(), state.log_probs.clone(), state.last_token.clone(),
                 state.done.clone())
        self.graph = capture(step_fn)
        step, tokens, log_probs, last, done = saved
        state.step.copy_(step), state.tokens.copy_(tokens), state.log_probs.copy_(log_probs)
        state.last_token.copy_(last), state.done.copy_(done)

    def replay(self) -> None:
        self.graph.replay()



class Clock:
    """Seconds per part of a generate call (synchronised on GPU), kept as engine.timing."""

    def __init__(self, device: torch.device):
        self.device = device
        self.laps: dict[str, float] = {}
        self.last = self._now()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, name: str) -> None:
        now = self._now()
        self.laps[name] = self.laps.get(name, 0.0) + now - self.last
        self.last = now
