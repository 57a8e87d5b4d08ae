"""Decode attention's Triton kernels (attention.triton_decode_attention launches them and says what
they compute): one program per row, KV head and split of the cache's columns streams the columns
that row sees with an online softmax; a second kernel merges a row's splits by their log-sum-exps.
Where a prompt's samples hold copies of its columns, a kernel before them streams the prompt's
whole blocks once for up to 16 query rows, and each row goes on from the running softmax it left.
Imported only where Triton is installed.

Every program walks a row's columns in one order, whole blocks from column 0 (or the row's first)
up, then the new token, then a head's sink: the state a prompt's kernel leaves after its blocks is
bit for bit the state a row's own walk holds there."""

import triton
import triton.language as tl


@triton.jit
def decode_attention_kernel(
    Q, K, V, KCache, VCache, Out, PartialOut, PartialLse, Pad, Column, Rows, Sinks,
    PrefixRow, PrefixLen, StateLen, StateAcc, StateM, StateTotal, scale,
    # strides: batch, head, column
    q_b, q_h, k_b, k_h, v_b, v_h, kc_b, kc_h, kc_l, vc_b, vc_h, vc_l,
    split_len, splits,
    GROUP: tl.constexpr, BLOCK_GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr, INDIRECT: tl.constexpr, COLUMN_STRIDE: tl.constexpr,
    SINKS: tl.constexpr, SHARED: tl.constexpr, STATE: tl.constexpr,
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
        # the G query heads of this KV head (q is [B, H, 1, D]): [BG, D]
        q_at = Q + slot * q_b + (kv_head * GROUP + g[:, None]) * q_h + d[None, :]
        q = tl.load(q_at, mask=g[:, None] < GROUP, other=0.0)
        k_new = tl.load(K + slot * k_b + kv_head * k_h + d)  # [D]
        v_new = tl.load(V + slot * v_b + kv_head * v_h + d)
        k_base = KCache + row * kc_b + kv_head * kc_h
        v_base = VCache + row * vc_b + kv_head * vc_h
        m, total, acc, lo = _walk_start(
            StateLen, StateAcc, StateM, StateTotal, slot, kv_head, g, d, lo,
            GROUP, BLOCK_GROUP, DIM, BLOCK, STATE,
        )  # fmt: skip
        # the columns [0, shared) this row holds as a copy of row `source`'s: read there
        source, shared = row, 0
        if SHARED:
            source, shared = tl.load(PrefixRow + row).to(tl.int64), tl.load(PrefixLen + row)
        m, total, acc = _attend_columns(
            q, k_base, v_base, (source - row) * kc_b, (source - row) * vc_b, shared, kc_l,
            vc_l, lo, hi, m, total, acc, scale, DIM, BLOCK,
        )  # fmt: skip
        m, total, acc = _join_new_token(
            q, k_new, v_new, k_base + column * kc_l + d, v_base + column * vc_l + d, owns_new,
            m, total, acc, scale,
        )  # fmt: skip
        # each head's sink logit joins the normaliser once: in the split with the new token
        if SINKS:
            m, total, acc = _join_sinks(Sinks + kv_head * GROUP, g, owns_new, m, total, acc, GROUP)
        _store_split(
            Out, PartialOut, PartialLse, slot, kv_head, split, splits, g, d, m, total, acc,
            GROUP, DIM, ONE_PASS,
        )  # fmt: skip


@triton.jit
def _walk_start(
    StateLen, StateAcc, StateM, StateTotal, slot, kv_head, g, d, lo,
    GROUP: tl.constexpr, BLOCK_GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
    STATE: tl.constexpr,
):  # fmt: skip
    """The running softmax (maximum, normaliser, weighted sum) a row's walk starts from, and its
    first column: empty from `lo`, or, in one pass over a row that sees its first column, the
    state its prompt's program left after the prompt's whole blocks."""
    m = tl.full([BLOCK_GROUP], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_GROUP], tl.float32)
    acc = tl.zeros([BLOCK_GROUP, DIM], tl.float32)
    if STATE:
        done_to = (tl.load(StateLen + slot) // BLOCK) * BLOCK
        if (lo == 0) & (done_to > 0):
            state = slot * GROUP * tl.num_programs(1) + kv_head * GROUP + g
            m = tl.load(StateM + state, mask=g < GROUP, other=0.0)
            total = tl.load(StateTotal + state, mask=g < GROUP, other=0.0)
            acc = tl.load(
                StateAcc + state[:, None] * DIM + d[None, :], mask=g[:, None] < GROUP, other=0.0
            )
            lo = done_to
    return m, total, acc, lo


@triton.jit
def shared_prefix_kernel(
    Q, KCache, VCache, Programs, StateAcc, StateM, StateTotal, scale,
    # strides: batch, head, column
    q_b, q_h, kc_b, kc_h, kc_l, vc_b, vc_h, vc_l,
    GROUP: tl.constexpr, GROUP_SPAN: tl.constexpr, MEMBERS: tl.constexpr, DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """One program per entry of `Programs` (the row a prompt's columns are in, how many, and up to
    MEMBERS query slots that hold them, -1 past the last) and KV head: the running softmax of each
    slot's G query heads over the whole blocks of those columns, read once for all of them, left
    in StateM, StateTotal, StateAcc [slots, H(, D)] for the slot's own program to go on from.
    MEMBERS x GROUP_SPAN (G rounded up to a power of two) is 16, the rows a one-row program's dot
    has: the same dot, the same bits per row."""
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    entry = Programs + program * (MEMBERS + 2)
    done_to = (tl.load(entry + 1) // BLOCK) * BLOCK
    if done_to > 0:
        source = tl.load(entry).to(tl.int64)
        r = tl.arange(0, MEMBERS * GROUP_SPAN)
        g = r % GROUP_SPAN
        slot = tl.load(entry + 2 + r // GROUP_SPAN)
        valid = (slot >= 0) & (g < GROUP)
        slot = tl.maximum(slot, 0).to(tl.int64)
        d = tl.arange(0, DIM)
        head = kv_head * GROUP + g
        q = tl.load(Q + slot[:, None] * q_b + head[:, None] * q_h + d[None, :], mask=valid[:, None],
                    other=0.0)  # fmt: skip
        m = tl.full([MEMBERS * GROUP_SPAN], float("-inf"), tl.float32)
        total = tl.zeros([MEMBERS * GROUP_SPAN], tl.float32)
        acc = tl.zeros([MEMBERS * GROUP_SPAN, DIM], tl.float32)
        m, total, acc = _attend_columns(
            q, KCache + source * kc_b + kv_head * kc_h, VCache + source * vc_b + kv_head * vc_h,
            0, 0, 0, kc_l, vc_l, 0, done_to, m, total, acc, scale, DIM, BLOCK,
        )  # fmt: skip
        state = slot * GROUP * tl.num_programs(1) + head
        tl.store(StateM + state, m, mask=valid)
        tl.store(StateTotal + state, total, mask=valid)
        tl.store(StateAcc + state[:, None] * DIM + d[None, :], acc, mask=valid[:, None])


@triton.jit
def _join_new_token(q, k_new, v_new, k_at, v_at, owns_new, m, total, acc, scale):
    """The running softmax (maximum m, normaliser total, weighted sum acc) of a split, with the new
    token where the split owns it: written to the cache at `k_at` and `v_at` for later steps, used
    from registers in this one. Last in the row's order, so the columns before it keep the order
    a prompt's kernel walks them in. A split with no columns holds m = -inf: the token's weight
    is then its all."""
    if owns_new:
        tl.store(k_at, k_new)
        tl.store(v_at, v_new)
    # [BG]
    new_score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
    m_new = tl.where(owns_new, tl.maximum(m, new_score), m)
    rescale = tl.exp(m - m_new)
    weight = tl.where(owns_new, tl.exp(new_score - m_new), 0.0)
    acc = acc * rescale[:, None] + weight[:, None] * v_new.to(tl.float32)[None, :]
    return m_new, total * rescale + weight, acc


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
    # no block where there are no columns: a block with none seen would make the maximum -inf
    first_block = tl.where(lo < hi, (lo // BLOCK) * BLOCK, hi)
    for start in range(first_block, hi, BLOCK):
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
