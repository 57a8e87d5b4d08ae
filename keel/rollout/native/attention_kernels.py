"""Decode attention's Triton kernels (attention.triton_decode_attention launches them and says what
they compute): one program per row, KV head and split of the cache's columns streams the columns
that row sees with an online softmax; a second kernel merges a row's splits by their log-sum-exps.
Where the caller passes the layer's QKV projection as it is (ROTARY), the program also makes its
query and key heads from it: each head's RMSNorm (QK_NORM, Qwen3) and the rotary embedding, which
would otherwise be two to five small kernels per layer before this one. Imported only where Triton
is installed."""

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
# Triton before 3.4: no programmatic launch (PROGRAMMATIC_LAUNCH_AVAILABLE; PDL never set)
except ImportError:
    gdc_launch_dependents = gdc_wait = None

PROGRAMMATIC_LAUNCH_AVAILABLE = gdc_wait is not None


@triton.jit
def decode_attention_kernel(
    Q, K, V, KCache, VCache, Out, PartialOut, PartialLse, Pad, Column, Rows, Sinks,
    PrefixRow, PrefixLen, Cos, Sin, QNorm, KNorm, eps, scale,
    # strides: batch, head, column
    q_b, q_h, k_b, k_h, v_b, v_h, kc_b, kc_h, kc_l, vc_b, vc_h, vc_l,
    split_len, splits,
    GROUP: tl.constexpr, BLOCK_GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr, INDIRECT: tl.constexpr, COLUMN_STRIDE: tl.constexpr,
    SINKS: tl.constexpr, SHARED: tl.constexpr, ROTARY: tl.constexpr, QK_NORM: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    programmatic_start(PDL)
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
        q, k_new = _query_and_key(
            Q + slot * q_b + (kv_head * GROUP + g[:, None]) * q_h, K + slot * k_b + kv_head * k_h,
            in_group, Cos + slot * DIM, Sin + slot * DIM, QNorm, KNorm, eps, ROTARY, QK_NORM, DIM,
        )  # fmt: skip
        v_new = tl.load(V + slot * v_b + kv_head * v_h + d)
        k_base = KCache + row * kc_b + kv_head * kc_h
        v_base = VCache + row * vc_b + kv_head * vc_h
        m, total, acc = _start_with_new_token(
            q, k_new, v_new, k_base + column * kc_l + d, v_base + column * vc_l + d, owns_new,
            scale, BLOCK_GROUP, DIM,
        )  # fmt: skip
        # the columns [0, shared) this row holds as a copy of row `source`'s: read there
        source, shared = row, 0
        if SHARED:
            source, shared = tl.load(PrefixRow + row).to(tl.int64), tl.load(PrefixLen + row)
        m, total, acc = _attend_columns(
            q, k_base, v_base, (source - row) * kc_b, (source - row) * vc_b, shared, kc_l,
            vc_l, lo, hi, m, total, acc, scale, DIM, BLOCK,
        )  # fmt: skip
        # each head's sink logit joins the normaliser once: in the split with the new token
        if SINKS:
            m, total, acc = _join_sinks(Sinks + kv_head * GROUP, g, owns_new, m, total, acc, GROUP)
        _store_split(
            Out, PartialOut, PartialLse, slot, kv_head, split, splits, g, d, m, total, acc,
            GROUP, DIM, ONE_PASS,
        )  # fmt: skip


@triton.jit
def programmatic_start(PDL: tl.constexpr):
    """Under Hopper's programmatic dependent launch (PDL: launched with launch_pdl) a grid may
    start while the kernel before it still runs: wait for that kernel's writes before the first
    read, then let the next such kernel start while this one runs."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _query_and_key(
    q_at, k_at, in_group, cos_at, sin_at, q_norm, k_norm, eps,
    ROTARY: tl.constexpr, QK_NORM: tl.constexpr, DIM: tl.constexpr,
):  # fmt: skip
    """This program's query heads [BG, D] (each starting at q_at [BG, 1]) and the new token's key
    [D] (at k_at): as given, or made from the projection by `_rotated` (ROTARY) and rounded to its
    dtype, as layers.attention_inputs rounds them."""
    d = tl.arange(0, DIM)
    if ROTARY:
        q = _rotated(q_at, in_group, cos_at, sin_at, q_norm, eps, QK_NORM, DIM)
        q = q.to(q_at.dtype.element_ty)
        # the key as one head [1, D]
        k = _rotated(k_at + tl.zeros([1, 1], tl.int32), d[None, :] < DIM, cos_at, sin_at, k_norm,
                     eps, QK_NORM, DIM)  # fmt: skip
        k = tl.reshape(k, [DIM]).to(k_at.dtype.element_ty)
    else:
        q = tl.load(q_at + d[None, :], mask=in_group, other=0.0)
        k = tl.load(k_at + d)
    return q, k


@triton.jit
def _rotated(
    x_at, mask, cos_at, sin_at, norm, eps, QK_NORM: tl.constexpr, DIM: tl.constexpr
):  # fmt: skip
    """Heads [n, D] of the projection, each starting at x_at [n, 1], as layers.attention_inputs
    makes them, in float32: RMS-normed by `norm` [D] (QK_NORM), rounded as that function's norm
    rounds (_scaled); then x cos + rotate_half(x) sin, where rotate_half(x) is
    [x2, x1] and its minus sign lives in `sin` (the row's cos and sin [D] at cos_at, sin_at)."""
    d = tl.arange(0, DIM)[None, :]
    half = (d + DIM // 2) % DIM
    x = tl.load(x_at + d, mask=mask, other=0.0).to(tl.float32)
    x_half = tl.load(x_at + half, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / DIM + eps)[:, None]
        x = _scaled(x * rstd, norm + d, x_at.dtype.element_ty)
        x_half = _scaled(x_half * rstd, norm + half, x_at.dtype.element_ty)
    cos = tl.load(cos_at + d).to(tl.float32)
    sin = tl.load(sin_at + d).to(tl.float32)
    return x * cos + x_half * sin


@triton.jit
def _scaled(normed, weight_at, dtype: tl.constexpr):
    """weight * normed as rms_norm computes it: the normed value rounded to the projection's
    `dtype`, the product to the weight's (torch's promotion: none for float32 norm weights)."""
    weight = tl.load(weight_at)
    product = weight.to(tl.float32) * normed.to(dtype).to(tl.float32)
    return product.to(weight.dtype).to(tl.float32)


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
    q, k_base, v_base, k_shift, v_shift, shared, kc_l, vc_l, lo, hi, m, total, acc, scale,
    DIM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Online softmax of q [BG, D] over the cache columns [lo, hi), BLOCK at a time, continuing
    from the running maximum m, normaliser total and weighted sum acc; the columns below
    `shared` read k_shift and v_shift elements on, in the row they are a copy of."""
    d = tl.arange(0, DIM)
    for start in range((lo // BLOCK) * BLOCK, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        seen = (cols >= lo) & (cols < hi)
        in_shared = (cols < shared)[:, None]
        # [BL, D]
        k = tl.load(
            k_base + tl.where(in_shared, k_shift, 0) + cols[:, None] * kc_l + d[None, :],
            mask=seen[:, None],
            other=0.0,
        )
        scores = tl.dot(q, tl.trans(k)) * scale  # [BG, BL] fp32
        scores = tl.where(seen[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        rescale = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        v = tl.load(
            v_base + tl.where(in_shared, v_shift, 0) + cols[:, None] * vc_l + d[None, :],
            mask=seen[:, None],
            other=0.0,
        )
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        total = total * rescale + tl.sum(p, axis=1)
        m = m_new
    return m, total, acc


@triton.jit
def merge_splits_kernel(
    PartialOut, PartialLse, Out, Pad, Column, split_len, splits,
    GROUP: tl.constexpr, BLOCK_GROUP: tl.constexpr, DIM: tl.constexpr,
    COLUMN_STRIDE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """A row's splits merged by their log-sum-exps: those from its first visible column's split
    to its new token's."""
    programmatic_start(PDL)
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
