"""The native engine's model runner: the weights (one copy, in the compute dtype), the model's
family (its layer math), the step functions compiled where they fuse, the decode attention kernel,
and the two forwards every generation is made of: a prefill pass over new tokens of some cache rows,
and a decode step over the rows generating now. It knows nothing of sequences, turns or budgets:
the scheduler (scheduler.py) decides which rows do what, and decode_state.py holds the rows."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from keel.models.load import can_compile
from keel.rollout.native import invariant
from keel.rollout.native.attention import (
    PROGRAMMATIC_LAUNCH_AVAILABLE,
    KernelConfig,
    SharedPrefix,
    sdpa_decode_attention,
    triton_available,
    triton_decode_attention,
)
from keel.rollout.native.layers import (
    StepFunctions,
    attention_inputs,
    embeddings,
    grouped_attention,
    window_start,
    within_window,
)
from keel.rollout.native.models import family_for
from keel.rollout.native.sampling import sample, token_log_prob
from keel.rollout.native.scheduler import Piece
from keel.rollout.native.weights import DecodeWeights
from keel.types import SamplingParams

# The decode kernel norms and rotates each layer's query and key heads itself (attention.Rotary)
# where the family's are layers.attention_inputs': two (Qwen2.5) to five (Qwen3) kernels fewer per
# layer. benchmarks/levers.py's norotary sets it off before an engine is made, to measure it.
ROTARY_IN_ATTENTION = True


# Hopper's programmatic dependent launch (PDL) for the decode step's Triton kernels, inductor's and
# keel's: each may start while the kernel before it ends and waits for that kernel's writes before
# its first read, which takes the launch gap between two kernels out of the step (about 1 us
# between each two of a step's 250-odd kernels, a quarter of t1's decode by its profile's idle
# share). Off until measured on a GPU: benchmarks/levers.py's pdl sets it on before an engine is
# made.
PROGRAMMATIC_LAUNCH = False


def programmatic_launch(device: torch.device) -> bool:
    """Whether the decode step's kernels take Hopper's programmatic dependent launch: switched on
    (PROGRAMMATIC_LAUNCH), on an sm_90 or newer GPU, with a Triton and an inductor that emit it."""
    import torch._inductor.config as inductor

    return (
        PROGRAMMATIC_LAUNCH
        and PROGRAMMATIC_LAUNCH_AVAILABLE
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) >= (9, 0)
        and hasattr(inductor.triton, "enable_pdl")
    )


def rotary_in_attention(family, use_triton: bool, batch_invariant: bool) -> bool:
    """Whether the decode attention kernel makes the query and key heads itself: Triton's kernel,
    not the batch-invariant arithmetic (its own attention), and a family whose attention inputs are
    layers.attention_inputs', which the kernel does as that function does."""
    plain_inputs = family.attention_inputs is attention_inputs
    return ROTARY_IN_ATTENTION and use_triton and not batch_invariant and plain_inputs


class ModelRunner:
    def __init__(
        self,
        model,
        dtype: torch.dtype,
        pad_token_id: int,
        enforce_eager: bool = False,
        compile_step: bool = True,
        compile_mode: str | None = None,
        batch_invariant: bool = False,
    ):
        self.dtype, self.pad_token_id = dtype, pad_token_id
        # the model's definition: its weights and layer math
        self.family = family_for(model.config)
        self.kv_heads, self.head_dim = self.family.kv_heads, self.family.head_dim
        self.device = next(model.parameters()).device
        self.weights = DecodeWeights(model, self.family, self.device, dtype)
        self.weights.load(model.named_parameters())
        self.batch_invariant = batch_invariant  # every pass in invariant.RowInvariant's arithmetic
        # enforce_eager (verl's key): no CUDA graphs or compilation (debugging; CPU's only way).
        # compile_mode: torch.compile's, for benchmarks/profile_decode.py (max-autotune: slower).
        self.use_cuda_graphs = not enforce_eager and self.device.type == "cuda"
        use_triton = triton_available(self.device, dtype, self.head_dim)
        self.programmatic = programmatic_launch(self.device)
        self.kernels = StepFunctions(
            self.family,
            self.use_cuda_graphs and compile_step and can_compile(self.device),
            compile_mode,
            exact=batch_invariant,
            rotary_in_attention=rotary_in_attention(self.family, use_triton, batch_invariant),
            programmatic=self.programmatic,
        )
        self._eager = StepFunctions(self.family, compiled=False)
        self.attention = triton_decode_attention if use_triton else sdpa_decode_attention
        if use_triton and self.programmatic:
            self.attention = partial(triton_decode_attention, config=KernelConfig(pdl=True))
        if batch_invariant:
            self.attention = invariant.decode_attention

    @property
    def eager(self) -> StepFunctions:
        """Prefill's functions: eager, but a batch-invariant prefill takes the decode step's (as
        swapped): the sampler and the old-log-prob pass then fuse and round alike, bit for bit."""
        return self.kernels if self.batch_invariant else self._eager

    @property
    def layers(self) -> int:
        return len(self.weights.layers)

    def cache_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype.itemsize

    def load_weights(self, named: Iterable[tuple[str, Tensor]], every: bool = True) -> None:
        self.weights.load(named, every)

    def arithmetic(self):
        """The context every pass runs in: batch-invariant (invariant.RowInvariant) or as is."""
        return invariant.RowInvariant() if self.batch_invariant else nullcontext()

    def sample(self, logits: Tensor, params: SamplingParams) -> tuple[Tensor, Tensor]:
        with self.arithmetic():
            return sample(
                logits, params, self.kernels.pickers, whole_row_log_prob=self.batch_invariant
            )

    def prefill(self, k_cache: list[Tensor], v_cache: list[Tensor], pieces: list[Piece]) -> Tensor:
        """One prefill pass: each row's new tokens attend to its cached columns and to each other,
        their K and V written after the cached ones -> logits [u, V] at each row's last new token.
        Rows start at cache column 0 (no left padding): a row's positions are its columns."""
        with self.arithmetic():
            h, lengths = self._prefill_hidden(k_cache, v_cache, pieces)
            return self._logits(h[torch.arange(len(pieces), device=self.device), lengths - 1])

    def prefill_hidden(
        self, k_cache: list[Tensor], v_cache: list[Tensor], pieces: list[Piece]
    ) -> tuple[Tensor, Tensor]:
        """prefill's pass up to the final norm -> hidden states [u, m, hidden] at every new token
        (m: the longest piece's; a shorter piece's tail is padding) and each piece's length [u]."""
        with self.arithmetic():
            return self._prefill_hidden(k_cache, v_cache, pieces)

    def logits(self, hidden: Tensor) -> Tensor:
        """The output layer over final hidden states [..., hidden] -> logits [..., V]."""
        with self.arithmetic():
            return self._logits(hidden)

    def _logits(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden.to(self.weights.lm_head.dtype), self.weights.lm_head)

    def log_probs(self, logits: Tensor, tokens: Tensor, temperature: float) -> Tensor:
        """Each row's token's log-prob under its temperature-scaled logits [rows, V]: the sampler's
        own expression (sampling.token_log_prob)."""
        with self.arithmetic():
            return token_log_prob(logits.float() / temperature, tokens)

    def _prefill_hidden(
        self, k_cache: list[Tensor], v_cache: list[Tensor], pieces: list[Piece]
    ) -> tuple[Tensor, Tensor]:
        w, device = self.weights, self.device
        u, width = len(pieces), max(len(new) for _, _, new in pieces)
        rows = torch.tensor([row for row, _, _ in pieces], device=device)
        lengths = torch.tensor([len(new) for _, _, new in pieces], device=device)
        ids = torch.full((u, width), self.pad_token_id, dtype=torch.long)
        for i, (_, _, new) in enumerate(pieces):
            ids[i, : len(new)] = torch.tensor(new)
        positions = torch.tensor([start for _, start, _ in pieces], device=device)[
            :, None
        ] + torch.arange(width, device=device)  # [u, m]
        end = max(start + len(new) for _, start, new in pieces)
        # (batch-invariant attention reads each query's columns, not a mask)
        plain_causal = self.batch_invariant or all(
            start == 0 and len(new) == width for _, start, new in pieces
        )
        # A padding query sees every column up to its position: finite, and never used.
        visible = (
            None
            if plain_causal
            else (torch.arange(end, device=device) <= positions[:, :, None])[:, None]
        )
        real = torch.arange(width, device=device) < lengths[:, None]
        piece_of, column_of = real.nonzero(as_tuple=True)
        cache_rows, cache_columns = rows[piece_of], positions[piece_of, column_of]
        # [u m, H]
        x = embeddings(ids.to(device), w.embed, self.family.embed_scale, w.stream_dtype).flatten(
            0, 1
        )

        def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            q, k, v = (t.view(u, width, t.shape[1], t.shape[-1]) for t in (q, k, v))  # [u, m, *, D]
            k_cache[i][cache_rows, :, cache_columns] = k[piece_of, column_of]
            v_cache[i][cache_rows, :, cache_columns] = v[piece_of, column_of]
            if self.batch_invariant:
                # every query, padding's too (finite, never used), over columns 0 to its own
                last = positions.flatten().clamp(max=k_cache[i].shape[2] - 1)
                at = (q.flatten(0, 1), k_cache[i], v_cache[i], rows.repeat_interleave(width))
                return invariant.attend(*at, torch.zeros_like(last), last).flatten(1)
            seen = within_window(visible, positions, end, self.family.window(i))
            attention = grouped_attention(
                q.transpose(1, 2),
                k_cache[i][rows, :, :end],
                v_cache[i][rows, :, :end],
                seen,
                w.layers[i].sinks,
            )
            return attention.transpose(1, 2).reshape(x.shape[0], -1)

        h = self.family.layers(self.eager, w, x, positions.flatten(), attend)
        return h.view(u, width, -1), lengths

    def decode_logits(
        self,
        last_token: Tensor,
        pad: Tensor,
        column: Tensor,
        k_cache: list[Tensor],
        v_cache: list[Tensor],
        rows: Tensor | None = None,
        prefix: SharedPrefix | None = None,
    ) -> Tensor:
        """Logits [B, V] for the last sampled token of every row, its K and V written to the cache
        at `column` (one for the batch, or each row's own). `rows`: each query's row of the cache
        (continuous batching), else query b is row b; `prefix`: where its first columns may be read.

        Around the attention (one Triton kernel on GPU, which also writes the cache), each layer is
        two pure functions that torch.compile fuses on GPU (norms, RoPE, residual adds and the SiLU
        gate become a handful of kernels around the matmuls): decoding a small model is bound by
        kernel launches and bytes read, not FLOPs."""
        with self.arithmetic():
            return self._decode_logits(last_token, pad, column, k_cache, v_cache, rows, prefix)

    def _decode_logits(self, last_token, pad, column, k_cache, v_cache, rows, prefix) -> Tensor:
        f, w = self.kernels, self.weights
        x, positions, visible = f.step_inputs(
            last_token,
            pad,
            column,
            k_cache[0].shape[2],
            w.embed,
            self.family.embed_scale,
            w.stream_dtype,
        )

        # also writes k, v to the cache; `rotary`: q and k as projected (StepFunctions.projection)
        def attend(i: int, q: Tensor, k: Tensor, v: Tensor, **rotary) -> Tensor:
            window, sinks = self.family.window(i), w.layers[i].sinks
            # the Triton kernel's; SDPA's is in its mask
            first = window_start(pad, column, window)
            seen = visible
            if window is not None:
                columns = torch.arange(visible.shape[-1], device=pad.device)
                seen = visible & (columns >= first[:, None])[:, None, None]
            at = (k_cache[i], v_cache[i], first, column, seen, rows, sinks, prefix)
            return self.attention(q, k, v, *at, **rotary)

        return self._logits(self.family.layers(f, w, x, positions, attend))
