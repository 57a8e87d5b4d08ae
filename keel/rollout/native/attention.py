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

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
# CPU installs: the SDPA path below
except ImportError:
    triton = None


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

    def resolved(self, cache_len: int, programs: int, sms: int) -> KernelConfig:
        """This config with split and num_stages chosen for `programs` rows x KV heads over a cache
        of `cache_len` columns on `sms` SMs, as benchmarks/attention_sweep.py measured them on an
        H200 (benchmarks/README.md):
        - splits only where the programs leave half the SMs idle (split_columns): at 128 and 256
          rows of Qwen2.5's two KV heads one pass streams 2.6-3.7 TB/s and every split was slower;
          at 8 rows over 2,304 columns the chosen splits of 128 take 10.9 us a layer against 16.9;
        - two pipeline stages from three programs per SM (1.5B at 256 rows: 36 us a layer against
          41 with three), three below (21 against 23 at 128 rows)."""
        whole = max(MIN_BLOCK, 1 << (cache_len - 1).bit_length())
        split = split_columns(cache_len, programs, sms) if self.split is None else self.split
        split = min(split or whole, whole)
        stages = (2 if programs >= 3 * sms else 3) if self.num_stages is None else self.num_stages
        # A power of two within its split, but not below tl.dot's 16 (a block past its split is
        # masked).
        block = max(MIN_BLOCK, 1 << (min(self.block, split).bit_length() - 1))
        return replace(self, split=split, block=block, num_stages=stages)


DEFAULT_CONFIG = KernelConfig()


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
) -> Tensor:
    """q [B, H, 1, D], the new token's k/v [B, KV, 1, D] written at `column` of the caches
    [B, KV, L, D]; visible [B, 1, 1, L] -> [B, H * D]. The G query heads of each KV head are given
    to SDPA as G query positions of one head, so K and V are read once, never repeated.

    With `rows` [B] (continuous batching) query b is cache row rows[b] of a larger cache, and
    `column` [B] is each row's own. `sinks` [H]: each head's attention sink (GPT-OSS), a logit in
    the softmax's normaliser that attends to nothing."""
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
    config: KernelConfig = DEFAULT_CONFIG,
) -> Tensor:
    """The same as sdpa_decode_attention in Triton; `visible` is implied by `pad` (the first column
    each row sees) and `column` (read on the device: no host sync).

    One program per row, KV head and split of the cache's columns: a program walks its columns one
    dependent block after another, so a few rows over a long cache (a continuous batch's tail)
    would leave most SMs idle without splits. Each split leaves its partial softmax (output and
    log-sum-exp) and a second kernel merges a row's splits; a split of the whole cache is one pass,
    without the merge. KernelConfig.resolved chooses the split; the split's length and count are
    runtime arguments, so a new cache length does not compile the kernels again. A head's sink
    joins the normaliser in the split that holds the new token, so the merge needs nothing of it.

    Two slots may share a cache row only at the same column (the batcher's scratch row): a slot's
    write at its column would race another's read of it."""
    batch, heads, _, dim = q.shape
    kv_heads, cache_len = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    sms = _multiprocessors(q.device)
    config = config.resolved(cache_len, batch * kv_heads, sms)
    split = config.split
    splits = triton.cdiv(cache_len, split)
    out = torch.empty(batch, heads, dim, device=q.device, dtype=q.dtype)
    partial, lse = _split_buffers(out, splits, (batch, kv_heads, group, dim))
    block_group = max(16, triton.next_power_of_2(group))
    # Laid out as the kernel's signature groups them (tensors, strides, split, constants): one
    # argument a line would hide which stride is whose.
    _decode_attention_kernel[(batch, kv_heads, splits)](
        q, k, v, k_cache, v_cache, out, partial, lse, pad, column, pad if rows is None else rows,
        pad if sinks is None else sinks, dim**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        split, splits,
        GROUP=group, BLOCK_GROUP=block_group, DIM=dim, BLOCK=config.block, ONE_PASS=splits == 1,
        INDIRECT=rows is not None, COLUMN_STRIDE=int(column.numel() > 1), SINKS=sinks is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(batch, kv_heads)](
            partial, lse, out, pad, column, split, splits,
            GROUP=group, BLOCK_GROUP=block_group, DIM=dim, COLUMN_STRIDE=int(column.numel() > 1),
            num_warps=config.merge_warps,
        )  # fmt: skip
    return out.view(batch, heads * dim)


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


if triton is not None:

    @triton.jit
    def _decode_attention_kernel(
        Q, K, V, KCache, VCache, Out, PartialOut, PartialLse, Pad, Column, Rows, Sinks, scale,
        # strides: batch, head, column
        q_b, q_h, k_b, k_h, v_b, v_h, kc_b, kc_h, kc_l, vc_b, vc_h, vc_l,
        split_len, splits,
        GROUP: tl.constexpr, BLOCK_GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
        ONE_PASS: tl.constexpr, INDIRECT: tl.constexpr, COLUMN_STRIDE: tl.constexpr,
        SINKS: tl.constexpr,
    ):  # fmt: skip
        # the query row; its cache row is Rows[slot] under continuous batching
        slot = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        column = tl.load(Column + slot * COLUMN_STRIDE)
        first = tl.load(Pad + slot)
        # This split's columns: [lo, hi) of those the row sees before its new token, which the split
        # holding `column` adds. Splits past it, or wholly before `first`, have nothing to do.
        lo = tl.maximum(first, split * split_len)
        hi = tl.minimum(column, split * split_len + split_len)
        owns_new = split == column // split_len
        if (lo < hi) | owns_new:
            if INDIRECT:
                row = tl.load(Rows + slot).to(tl.int64)
            else:
                row = slot.to(tl.int64)
            g = tl.arange(0, BLOCK_GROUP)
            d = tl.arange(0, DIM)
            in_group = g[:, None] < GROUP
            # The G query heads of this KV head: q is [B, H, 1, D], heads kv_head*G .. kv_head*G +
            # G-1.
            q = tl.load(
                Q + slot * q_b + (kv_head * GROUP + g[:, None]) * q_h + d[None, :],
                mask=in_group,
                other=0.0,
            )  # [BG, D]
            k_new = tl.load(K + slot * k_b + kv_head * k_h + d)  # [D]
            v_new = tl.load(V + slot * v_b + kv_head * v_h + d)
            k_base = KCache + row * kc_b + kv_head * kc_h
            v_base = VCache + row * vc_b + kv_head * vc_h
            m, total, acc = _start_with_new_token(
                q, k_new, v_new, k_base + column * kc_l + d, v_base + column * vc_l + d, owns_new,
                scale, BLOCK_GROUP, DIM,
            )  # fmt: skip
            m, total, acc = _attend_columns(
                q, k_base, v_base, kc_l, vc_l, lo, hi, m, total, acc, scale, DIM, BLOCK
            )
            # each head's sink logit joins the normaliser once: in the split with the new token
            if SINKS:
                m, total, acc = _join_sinks(
                    Sinks + kv_head * GROUP, g, owns_new, m, total, acc, GROUP
                )
            _store_split(
                Out, PartialOut, PartialLse, slot, kv_head, split, splits, g, d, m, total, acc,
                GROUP, DIM, ONE_PASS,
            )  # fmt: skip

    @triton.jit
    def _start_with_new_token(
        q, k_new, v_new, k_at, v_at, owns_new, scale,
        BLOCK_GROUP: tl.constexpr, DIM: tl.constexpr,
    ):  # fmt: skip
        """The running softmax (maximum, normaliser, weighted sum) of a split: empty, or in the
        split that owns it the new token, written to the cache at `k_at` and `v_at` for later steps,
        used from registers in this one, and first in its split, so the running maximum is finite
        from the start."""
        if owns_new:
            tl.store(k_at, k_new)
            tl.store(v_at, v_new)
        # [BG]
        new_score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
        m = tl.where(owns_new, new_score, float("-inf"))
        total = tl.zeros([BLOCK_GROUP], tl.float32) + owns_new.to(tl.float32)
        acc = (
            tl.zeros([BLOCK_GROUP, DIM], tl.float32)
            + (v_new.to(tl.float32) * owns_new.to(tl.float32))[None, :]
        )
        return m, total, acc

    @triton.jit
    def _store_split(
        Out, PartialOut, PartialLse, slot, kv_head, split, splits, g, d, m, total, acc,
        GROUP: tl.constexpr, DIM: tl.constexpr, ONE_PASS: tl.constexpr,
    ):  # fmt: skip
        """A split's result: the row's output itself when it is the only split, else its partial
        output and log-sum-exp for the merge."""
        in_group = g[:, None] < GROUP
        heads = GROUP * tl.num_programs(1)
        if ONE_PASS:
            out_ptrs = Out + slot * heads * DIM + (kv_head * GROUP + g[:, None]) * DIM + d[None, :]
            tl.store(out_ptrs, (acc / total[:, None]).to(Out.dtype.element_ty), mask=in_group)
        # [B, KV, splits, G, D] and [B, KV, splits, G], fp32
        else:
            part = (slot * tl.num_programs(1) + kv_head) * splits + split
            tl.store(
                PartialOut + (part * GROUP + g[:, None]) * DIM + d[None, :],
                acc / total[:, None],
                mask=in_group,
            )
            tl.store(PartialLse + part * GROUP + g, m + tl.log(total), mask=g < GROUP)

    @triton.jit
    def _join_sinks(sinks, g, owns_new, m, total, acc, GROUP: tl.constexpr):
        """The running softmax (maximum m, normaliser total, weighted sum acc) of a KV head's G
        query heads with each head's sink logit in the normaliser, where this split holds the new
        token."""
        sink = tl.load(sinks + g, mask=g < GROUP, other=float("-inf")).to(tl.float32)
        sink = tl.where(owns_new, sink, float("-inf"))
        m_new = tl.maximum(m, sink)
        rescale = tl.exp(m - m_new)
        return m_new, total * rescale + tl.exp(sink - m_new), acc * rescale[:, None]

    @triton.jit
    def _attend_columns(
        q, k_base, v_base, kc_l, vc_l, lo, hi, m, total, acc, scale,
        DIM: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Online softmax of q [BG, D] over the cache columns [lo, hi), BLOCK at a time, continuing
        from the running maximum m, normaliser total and weighted sum acc."""
        d = tl.arange(0, DIM)
        for start in range((lo // BLOCK) * BLOCK, hi, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            seen = (cols >= lo) & (cols < hi)
            # [BL, D]
            k = tl.load(k_base + cols[:, None] * kc_l + d[None, :], mask=seen[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale  # [BG, BL] fp32
            scores = tl.where(seen[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            rescale = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            v = tl.load(v_base + cols[:, None] * vc_l + d[None, :], mask=seen[:, None], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
            total = total * rescale + tl.sum(p, axis=1)
            m = m_new
        return m, total, acc

    @triton.jit
    def _merge_splits_kernel(
        PartialOut, PartialLse, Out, Pad, Column, split_len, splits,
        GROUP: tl.constexpr, BLOCK_GROUP: tl.constexpr, DIM: tl.constexpr,
        COLUMN_STRIDE: tl.constexpr,
    ):  # fmt: skip
        """A row's splits merged by their log-sum-exps: those from its first visible column's split
        to its new token's."""
        slot = tl.program_id(0)
        kv_head = tl.program_id(1)
        column = tl.load(Column + slot * COLUMN_STRIDE)
        first = tl.load(Pad + slot)
        g = tl.arange(0, BLOCK_GROUP)
        d = tl.arange(0, DIM)
        in_group = g < GROUP
        m = tl.full([BLOCK_GROUP], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_GROUP], tl.float32)
        acc = tl.zeros([BLOCK_GROUP, DIM], tl.float32)
        for split in range(tl.minimum(first, column) // split_len, column // split_len + 1):
            part = (slot * tl.num_programs(1) + kv_head) * splits + split
            lse = tl.load(PartialLse + part * GROUP + g, mask=in_group, other=0.0)
            out = tl.load(
                PartialOut + (part * GROUP + g[:, None]) * DIM + d[None, :],
                mask=in_group[:, None],
                other=0.0,
            )
            m_new = tl.maximum(m, lse)
            rescale = tl.exp(m - m_new)
            weight = tl.exp(lse - m_new)
            acc = acc * rescale[:, None] + out * weight[:, None]
            total = total * rescale + weight
            m = m_new
        heads = GROUP * tl.num_programs(1)
        out_ptrs = Out + slot * heads * DIM + (kv_head * GROUP + g[:, None]) * DIM + d[None, :]
        tl.store(out_ptrs, (acc / total[:, None]).to(Out.dtype.element_ty), mask=in_group[:, None])
