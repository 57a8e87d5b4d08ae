"""Decode attention's Triton kernels (attention.triton_decode_attention launches them and says what
they compute): one program per row, KV head and split of the cache's columns streams the columns
that row sees with an online softmax; a second kernel merges a row's splits by their log-sum-exps.
Imported only where Triton is installed."""

import triton
import triton.language as tl


@triton.jit
def decode_attention_kernel(
    Q, K, V, KCache, VCache, Out, PartialOut, PartialLse, Pad, Column, Rows, Sinks,
    PrefixRow, PrefixLen, scale,
    # strides: batch, head, column
    q_b, q_h, k_b, k_h, v_b, v_h, kc_b, kc_h, kc_l, vc_b, vc_h, vc_l,
    batch, split_len, splits,
    GROUP: tl.constexpr, BLOCK_GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr, INDIRECT: tl.constexpr, COLUMN_STRIDE: tl.constexpr,
    SINKS: tl.constexpr, SHARED: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    # ROWS query rows (slots), each with the G query heads of this KV head: query g is head g % G
    # of slot first + g // G. Their cache rows are Rows[slot] under continuous batching.
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    first = tl.program_id(0) * ROWS
    g = tl.arange(0, BLOCK_GROUP)
    d = tl.arange(0, DIM)
    q_slot = first + g // GROUP
    q_valid = (g < ROWS * GROUP) & (q_slot < batch)
    q_row, q_lo, q_hi, q_owns = _query_columns(
        Rows, Pad, Column, q_slot, q_valid, split, split_len, INDIRECT, COLUMN_STRIDE
    )
    # This split's columns: [lo, hi) of those each row sees before its new token, which the split
    # holding `column` adds. Splits past it, or wholly before the first, have nothing to do.
    q_active = q_valid & ((q_lo < q_hi) | q_owns)
    if tl.max(q_active.to(tl.int32), axis=0) > 0:
        q = tl.load(
            Q + q_slot[:, None] * q_b + (kv_head * GROUP + g % GROUP)[:, None] * q_h + d[None, :],
            mask=q_valid[:, None],
            other=0.0,
        )  # [BG, D]
        m, total, acc = _start_with_new_tokens(
            q, K + q_slot[:, None] * k_b + kv_head * k_h + d[None, :],
            V + q_slot[:, None] * v_b + kv_head * v_h + d[None, :],
            KCache + q_row[:, None] * kc_b + kv_head * kc_h + d[None, :],
            VCache + q_row[:, None] * vc_b + kv_head * vc_h + d[None, :],
            Column + q_slot * COLUMN_STRIDE, q_valid, q_owns, g % GROUP == 0, kc_l, vc_l, scale,
        )  # fmt: skip
        # With SHARED, columns [0, shared) that a row holds as a copy of row `source`'s are read
        # there. Where the ROWS rows are one prompt's samples at one column, its whole blocks are
        # read once for all of them (`joint`); then each row's own.
        joint = 0
        if SHARED:
            joint = _joint_prefix_end(PrefixRow, PrefixLen, q_row, q_lo, q_hi, q_valid, BLOCK)
            if joint > 0:
                source = tl.load(PrefixRow + tl.max(tl.where(q_valid, q_row, 0), axis=0))
                m, total, acc = _attend_columns(
                    q, q_valid, KCache + source * kc_b + kv_head * kc_h,
                    VCache + source * vc_b + kv_head * vc_h, 0, 0, 0, kc_l, vc_l,
                    tl.max(tl.where(q_valid, q_lo, 0), axis=0), joint, m, total, acc, scale,
                    DIM, BLOCK,
                )  # fmt: skip
        for r in tl.static_range(ROWS):
            slot = first + r
            if slot < batch:
                row, lo, hi, _ = _query_columns(
                    Rows, Pad, Column, slot, True, split, split_len, INDIRECT, COLUMN_STRIDE
                )
                source, shared = row, 0
                if SHARED:
                    source, shared = tl.load(PrefixRow + row).to(tl.int64), tl.load(PrefixLen + row)
                m, total, acc = _attend_columns(
                    q, q_valid & (g // GROUP == r), KCache + row * kc_b + kv_head * kc_h,
                    VCache + row * vc_b + kv_head * vc_h, (source - row) * kc_b,
                    (source - row) * vc_b, shared, kc_l, vc_l, tl.maximum(lo, joint), hi, m,
                    total, acc, scale, DIM, BLOCK,
                )  # fmt: skip
        # each head's sink logit joins the normaliser once: in the split with the new token
        if SINKS:
            m, total, acc = _join_sinks(
                Sinks + kv_head * GROUP + g % GROUP, q_valid & q_owns, m, total, acc
            )
        _store_split(
            Out, PartialOut, PartialLse, q_slot, kv_head, split, splits, g % GROUP, d, m, total,
            acc, q_active, GROUP, DIM, ONE_PASS,
        )  # fmt: skip


@triton.jit
def _query_columns(
    Rows, Pad, Column, slot, valid, split, split_len,
    INDIRECT: tl.constexpr, COLUMN_STRIDE: tl.constexpr,
):  # fmt: skip
    """Of a slot (or a vector of them): its cache row, the columns [lo, hi) this split reads of
    those it sees, and whether this split holds its new token."""
    row = slot.to(tl.int64)
    if INDIRECT:
        row = tl.load(Rows + slot, mask=valid, other=0).to(tl.int64)
    column = tl.load(Column + slot * COLUMN_STRIDE, mask=valid, other=0)
    lo = tl.maximum(tl.load(Pad + slot, mask=valid, other=0), split * split_len)
    hi = tl.minimum(column, split * split_len + split_len)
    return row, lo, hi, valid & (split == column // split_len)


@triton.jit
def _joint_prefix_end(PrefixRow, PrefixLen, q_row, q_lo, q_hi, q_valid, BLOCK: tl.constexpr):
    """Where the queries' rows are one prompt's samples (each a copy of one source row's first
    `length` columns, or that row itself) at the same columns [lo, hi): the end of the whole blocks
    they read in the source row, else 0."""
    source = tl.load(PrefixRow + q_row, mask=q_valid, other=0)
    length = tl.load(PrefixLen + q_row, mask=q_valid, other=0)
    big = 1 << 62
    top = tl.max(tl.where(q_valid, source, -1), axis=0)
    same_source = tl.min(tl.where(q_valid, source, big), axis=0) == top
    most = tl.max(tl.where(q_valid, length, 0), axis=0)
    # the source row itself holds no copy (length 0): it reads its own columns, the same ones
    same_length = tl.min(tl.where(q_valid & ((length == most) | (q_row == top)), 1, 0), axis=0)
    same_lo = tl.min(tl.where(q_valid, q_lo, big), axis=0) == tl.max(
        tl.where(q_valid, q_lo, -1), axis=0
    )
    hi = tl.max(tl.where(q_valid, q_hi, -1), axis=0)
    same_hi = tl.min(tl.where(q_valid, q_hi, big), axis=0) == hi
    joint = same_source & (same_length > 0) & same_lo & same_hi
    return tl.where(joint, (tl.minimum(most, hi) // BLOCK) * BLOCK, 0)


@triton.jit
def _start_with_new_tokens(
    q, k_new_at, v_new_at, k_cache_at, v_cache_at, column_at, valid, owns_new, writes, kc_l, vc_l,
    scale,
):  # fmt: skip
    """The running softmax (maximum, normaliser, weighted sum) of each query in a split: empty, or
    in the split that owns it its row's new token, written to the cache at its column for later
    steps (once a row: `writes`), used from registers in this one, and first in its split, so the
    running maximum is finite from the start."""
    k_new = tl.load(k_new_at, mask=valid[:, None], other=0.0)  # [BG, D]
    v_new = tl.load(v_new_at, mask=valid[:, None], other=0.0)
    column = tl.load(column_at, mask=valid, other=0)[:, None]
    tl.store(k_cache_at + column * kc_l, k_new, mask=(owns_new & writes)[:, None])
    tl.store(v_cache_at + column * vc_l, v_new, mask=(owns_new & writes)[:, None])
    new_score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * scale  # [BG]
    m = tl.where(owns_new, new_score, float("-inf"))
    total = owns_new.to(tl.float32)
    acc = v_new.to(tl.float32) * owns_new.to(tl.float32)[:, None]
    return m, total, acc


@triton.jit
def _store_split(
    Out, PartialOut, PartialLse, q_slot, kv_head, split, splits, head, d, m, total, acc, active,
    GROUP: tl.constexpr, DIM: tl.constexpr, ONE_PASS: tl.constexpr,
):  # fmt: skip
    """A split's result for each active query (its slot's `head` of this KV head): the output
    itself when it is the only split, else its partial output and log-sum-exp for the merge."""
    heads = GROUP * tl.num_programs(1)
    if ONE_PASS:
        out_ptrs = Out + q_slot[:, None] * heads * DIM + (kv_head * GROUP + head)[:, None] * DIM
        tl.store(
            out_ptrs + d[None, :],
            (acc / total[:, None]).to(Out.dtype.element_ty),
            mask=active[:, None],
        )
    # [B, KV, splits, G, D] and [B, KV, splits, G], fp32
    else:
        part = (q_slot * tl.num_programs(1) + kv_head) * splits + split
        tl.store(
            PartialOut + ((part * GROUP + head) * DIM)[:, None] + d[None, :],
            acc / total[:, None],
            mask=active[:, None],
        )
        tl.store(PartialLse + part * GROUP + head, m + tl.log(total), mask=active)


@triton.jit
def _join_sinks(sinks_at, owns_new, m, total, acc):
    """The running softmax (maximum m, normaliser total, weighted sum acc) of each query with its
    head's sink logit in the normaliser, where this split holds its row's new token."""
    sink = tl.load(sinks_at, mask=owns_new, other=float("-inf")).to(tl.float32)
    m_new = tl.maximum(m, sink)
    rescale = tl.where(m_new == m, 1.0, tl.exp(m - m_new))
    return (
        m_new,
        total * rescale + tl.where(owns_new, tl.exp(sink - m_new), 0.0),
        acc * rescale[:, None],
    )


@triton.jit
def _attend_columns(
    q, mine, k_base, v_base, k_shift, v_shift, shared, kc_l, vc_l, lo, hi, m, total, acc, scale,
    DIM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Online softmax of the queries `mine` of q [BG, D] over the cache columns [lo, hi) of one
    row, BLOCK at a time, continuing from the running maximum m, normaliser total and weighted sum
    acc (the other queries' unchanged, bit for bit); the columns below `shared` read k_shift and
    v_shift elements on, in the row they are a copy of."""
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
        counted = mine[:, None] & seen[None, :]
        scores = tl.where(counted, tl.dot(q, tl.trans(k)) * scale, float("-inf"))  # [BG, BL] fp32
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        # 1 where the maximum stays: a query with nothing counted yet, or not `mine`, keeps its bits
        rescale = tl.where(m_new == m, 1.0, tl.exp(m - m_new))
        p = tl.where(counted, tl.exp(scores - m_new[:, None]), 0.0)
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
