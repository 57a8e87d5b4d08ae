"""Decode attention: one new query token per row against its KV cache, grouped-query.

Two implementations with one signature. On a GPU with Triton, a kernel writes the new token's K
and V into the cache and attends (flash-decoding): each program takes one row, one KV head and one
split of the columns (the whole cache unless few rows would leave SMs idle), holds the G query
heads that share the KV head, and streams only the columns that row can see, so neither the
unwritten tail of the static cache nor the left padding is read, and K/V are never repeated to H
heads; a second kernel merges the splits. Elsewhere (CPU, float32) the cache write and SDPA over a
masked cache do the same.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton

    from keel.rollout.native.attention_kernels import (
        PROGRAMMATIC_LAUNCH_AVAILABLE,
        decode_attention_kernel,
        merge_splits_kernel,
    )
# CPU installs: the SDPA path below
except ImportError:
    triton = None
    PROGRAMMATIC_LAUNCH_AVAILABLE = False


# tl.dot's least inner size for 16-bit inputs
MIN_BLOCK = 16


@dataclass(frozen=True)
class KernelConfig:
    """The Triton kernel's tiling: cache columns per split (0: the whole cache, one pass) and per
    inner step, and its launch settings. None: chosen for the launch's shape by `resolved`."""

    split: int | None = None
    block: int = 64
    num_warps: int = 4
    num_stages: int | None = None
    merge_warps: int = 4
    # launched with Hopper's programmatic dependent launch (runner.programmatic_launch)
    pdl: bool = False

    def resolved(
        self, cache_len: int, programs: int, sms: int, shared: bool = False
    ) -> KernelConfig:
        """This config with split and num_stages chosen for `programs` rows x KV heads over a cache
        of `cache_len` columns on `sms` SMs, as benchmarks/attention_sweep.py measured them on an
        H200 (benchmarks/README.md):
        - splits only where the programs leave half the SMs idle (split_columns): at 128 and 256
          rows of Qwen2.5's two KV heads one pass streams 2.6-3.7 TB/s and every split was slower;
          at 8 rows over 2,304 columns the chosen splits of 128 take 10.9 us a layer against 16.9;
        - two pipeline stages from three programs per SM (1.5B at 256 rows: 36 us a layer against
          41 with three), three below (21 against 23 at 128 rows);
        - three where a prompt's copies are read in its one row (`shared`), whose reads come
          from L2: Qwen3-0.6B's 128 rows, 1,024 programs, 48.4 us a layer against 55.0 with two,
          and 46.8 against 51.3 in another call (one H100); reading their own rows, 71.8 against
          70.6."""
        whole = max(MIN_BLOCK, 1 << (cache_len - 1).bit_length())
        split = split_columns(cache_len, programs, sms) if self.split is None else self.split
        split = min(split or whole, whole)
        stages = 3 if shared or programs < 3 * sms else 2
        stages = stages if self.num_stages is None else self.num_stages
        # A power of two within its split, but not below tl.dot's 16 (a block past its split is
        # masked).
        block = max(MIN_BLOCK, 1 << (min(self.block, split).bit_length() - 1))
        return replace(self, split=split, block=block, num_stages=stages)


DEFAULT_CONFIG = KernelConfig()


class SharedPrefix(NamedTuple):
    """Per cache row (the cache's first dimension): the row whose columns [0, length) this row holds
    a copy of (a prompt's samples, copied from its one prefill; itself and 0 where none), so the
    Triton kernel reads them there: one prompt's keys and values from HBM once for all its samples.
    The kernel looks up each query's own cache row: nothing is gathered per step."""

    row: Tensor
    length: Tensor


class Rotary(NamedTuple):
    """What turns a layer's projected query and key heads into attention's inputs, for a kernel that
    does it itself (layers.attention_inputs otherwise): each row's cos and sin [B, 1, D] (the sign
    of rotate_half in sin), each head's query and key RMSNorm weights [D] (None: the layer has
    none) and its eps."""

    cos: Tensor
    sin: Tensor
    q_norm: Tensor | None
    k_norm: Tensor | None
    eps: float


@cache
def _multiprocessors(device: torch.device) -> int:
    """The device's SM count, read once: an eager decode (no CUDA graphs) calls the kernel per layer
    and step."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_columns(cache_len: int, programs: int, sms: int, minimum: int = 64) -> int:
    """Columns per split, a power of two, or 0 (one pass) when the programs occupy half the SMs or
    more: else the split that gives four programs per SM over the whole cache, rounded up to a power
    of two (two to four per SM)."""
    if 2 * programs >= sms:
        return 0
    wanted = -(-cache_len * programs // (4 * sms))
    return max(minimum, 1 << (wanted - 1).bit_length())


def sdpa_decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    pad: Tensor,
    column: Tensor,
    visible: Tensor,
    rows: Tensor | None = None,
    sinks: Tensor | None = None,
    prefix: SharedPrefix | None = None,
) -> Tensor:
    """q [B, H, 1, D], the new token's k/v [B, KV, 1, D] written at `column` of the caches
    [B, KV, L, D]; visible [B, 1, 1, L] -> [B, H * D]. The G query heads of each KV head are given
    to SDPA as G query positions of one head, so K and V are read once, never repeated.

    With `rows` [B] (continuous batching) query b is cache row rows[b] of a larger cache, and
    `column` [B] is each row's own. `sinks` [H]: each head's attention sink (GPT-OSS), a logit in
    the softmax's normaliser that attends to nothing. `prefix` is the Triton kernel's alone: each
    row's own cache holds the same columns, so reading them here gives the same result."""
    write_new_token(k, v, k_cache, v_cache, column, rows)
    k_cache, v_cache = (k_cache, v_cache) if rows is None else (k_cache[rows], v_cache[rows])
    batch, heads, _, dim = q.shape
    grouped = q.view(batch, k_cache.shape[1], heads // k_cache.shape[1], dim)  # [B, KV, G, D]
    if sinks is not None:
        grouped_sinks = sinks.view(1, k_cache.shape[1], heads // k_cache.shape[1], 1)
        return attention_with_sinks(grouped, k_cache, v_cache, visible, grouped_sinks).reshape(
            batch, heads * dim
        )
    return F.scaled_dot_product_attention(grouped, k_cache, v_cache, attn_mask=visible).reshape(
        batch, heads * dim
    )


def write_new_token(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, column: Tensor, rows: Tensor | None
) -> None:
    """The new token's k, v [B, KV, 1, D] into the caches at `column`: rows 0..B-1, or `rows`."""
    if rows is None:
        k_cache.index_copy_(2, column, k)
        v_cache.index_copy_(2, column, v)
    else:
        k_cache[rows, :, column], v_cache[rows, :, column] = k[:, :, 0], v[:, :, 0]


def attention_with_sinks(
    q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None, sinks: Tensor
) -> Tensor:
    """Softmax attention of q [..., L, D] over k, v [..., S, D] (heads matched) whose normaliser
    also holds each head's sink logit (`sinks`, broadcast to [..., L, 1]), as GPT-OSS computes it:
    in float32, the sink's share dropped. `visible` [..., L, S] (None: causal). SDPA has no
    sinks."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if visible is None:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(
            scores.shape[-1] - scores.shape[-2]
        )
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs @ v.float()).to(q.dtype)


def triton_decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    pad: Tensor,
    column: Tensor,
    visible: Tensor | None = None,
    rows: Tensor | None = None,
    sinks: Tensor | None = None,
    prefix: SharedPrefix | None = None,
    config: KernelConfig = DEFAULT_CONFIG,
    rotary: Rotary | None = None,
) -> Tensor:
    """The same as sdpa_decode_attention in Triton; `visible` is implied by `pad` (the first column
    each row sees) and `column` (read on the device: no host sync). `rotary`: q and k are views of
    the projection, normed and rotated by each program as layers.attention_inputs would.

    One program per row, KV head and split of the cache's columns: a program walks its columns one
    dependent block after another, so a few rows over a long cache (a continuous batch's tail)
    would leave most SMs idle without splits. Each split leaves its partial softmax (output and
    log-sum-exp) and a second kernel merges a row's splits; a split of the whole cache is one pass,
    without the merge. KernelConfig.resolved chooses the split; the split's length and count are
    runtime arguments, so a new cache length does not compile the kernels again. A head's sink
    joins the normaliser in the split that holds the new token, so the merge needs nothing of it.

    `prefix`: the columns a row holds as a copy of another's are read there. A prompt's samples run
    side by side, so its keys and values come from HBM once, then L2: the same bits, same result.
    Two slots may share a cache row only at the same column (the batcher's scratch row): a slot's
    write at its column would race another's read of it."""
    batch, heads, _, dim = q.shape
    kv_heads, cache_len, group = k_cache.shape[1], k_cache.shape[2], heads // k_cache.shape[1]
    sms, shared = _multiprocessors(q.device), prefix is not None
    config = config.resolved(cache_len, batch * kv_heads, sms, shared=shared)
    split, splits = config.split, triton.cdiv(cache_len, config.split)
    out = torch.empty(batch, heads, dim, device=q.device, dtype=q.dtype)
    partial, lse = _split_buffers(out, splits, (batch, kv_heads, group, dim))
    block_group = max(16, triton.next_power_of_2(group))
    # Laid out as the kernel's signature groups them (tensors, strides, split, constants): one
    # argument a line would hide which stride is whose.
    decode_attention_kernel[(batch, kv_heads, splits)](
        q, k, v, k_cache, v_cache, out, partial, lse, pad, column,
        *_optional_inputs(pad, rows, sinks, prefix, rotary), dim**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        split, splits,
        GROUP=group, BLOCK_GROUP=block_group, DIM=dim, BLOCK=config.block, ONE_PASS=splits == 1,
        INDIRECT=rows is not None, COLUMN_STRIDE=int(column.numel() > 1), SINKS=sinks is not None,
        SHARED=shared, ROTARY=rotary is not None, QK_NORM=_has_norms(rotary), PDL=config.pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=config.pdl,
    )  # fmt: skip
    if splits > 1:
        merge_splits_kernel[(batch, kv_heads)](
            partial, lse, out, pad, column, split, splits,
            GROUP=group, BLOCK_GROUP=block_group, DIM=dim, COLUMN_STRIDE=int(column.numel() > 1),
            PDL=config.pdl, num_warps=config.merge_warps, launch_pdl=config.pdl,
        )  # fmt: skip
    return out.view(batch, heads * dim)


def _has_norms(rotary: Rotary | None) -> bool:
    return rotary is not None and rotary.q_norm is not None


def _optional_inputs(stand_in: Tensor, rows, sinks, prefix, rotary) -> tuple:
    """The kernel's optional tensors in its order (Rows, Sinks, PrefixRow, PrefixLen, Cos, Sin,
    QNorm, KNorm), `stand_in` for each one absent (its flag keeps it unread), then eps."""
    cos, sin, q_norm, k_norm, eps = rotary or (None, None, None, None, 0.0)
    tensors = (rows, sinks, *(prefix or (None, None)), cos, sin, q_norm, k_norm)
    return (*(stand_in if t is None else t for t in tensors), eps)


def _split_buffers(out: Tensor, splits: int, shape: tuple[int, int, int, int]):
    """Where each split leaves its partial output [B, KV, splits, G, D] and log-sum-exp
    [B, KV, splits, G], in float32; with one split the kernel writes `out` and uses neither."""
    if splits == 1:
        return out, out
    batch, kv_heads, group, dim = shape
    partial = torch.empty(
        batch, kv_heads, splits, group, dim, device=out.device, dtype=torch.float32
    )
    lse = torch.empty(batch, kv_heads, splits, group, device=out.device, dtype=torch.float32)
    return partial, lse


def triton_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """The kernel runs on CUDA in 16-bit types (its dot products would round float32 to tf32) with
    a power-of-two head size."""
    return (
        triton is not None
        and device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
    )
