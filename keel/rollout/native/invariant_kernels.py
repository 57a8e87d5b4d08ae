"""rollout.batch_invariant's arithmetic on a GPU (invariant.py says the contract): Triton kernels
whose tiling is fixed whatever the shape they are given, so an output row's additions happen in
one order, decided by its own data only.

- `linear`: x W^T + b in tiles of 64 x 64, K 64 at a time in order, float32 accumulation. A
  narrow weight's K is summed in a few chunks, their float32 partials added in order (k_chunks):
  the chunks are set by the weight's shape alone, where cuBLAS picks its kernel, and whether to
  split K, by the number of rows;
- `rms_norm` and `logsumexp`: one program per row, the row's blocks in order;
- `attend`: each query over exactly the cache columns it sees, first to last in blocks of 64
  counted from its first column, an online softmax in float32 (a decoding token and the same
  token in a prefill run the same program on the same columns).

The matmul is slower than cuBLAS's best tile for a given shape; that is the price of one order."""

from __future__ import annotations

import math

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: invariant.py's row-at-a-time reference runs there
    triton = None

TILE = 64  # rows, columns and K of a matmul tile; cache columns per attention block
# Column tiles times K chunks a narrow matmul is cut into, and the fewest K tiles a chunk holds: a
# decode step's 128 rows are 2 row tiles, and Qwen2.5-0.5B's down projection (896 columns, K 4864)
# would otherwise be 28 programs stepping through 76 K tiles each on a GPU of 132 SMs.
SPLIT_PROGRAMS = 64
CHUNK_TILES = 4
NORM_BLOCK = 4096  # vocabulary entries per logsumexp block


def precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: float32 inputs exact ("ieee"), not rounded to tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def k_chunks(n: int, k: int) -> int:
    """K tiles per chunk of a weight with N columns and K inputs: the whole K, or for a narrow
    weight a few chunks of at least CHUNK_TILES tiles, SPLIT_PROGRAMS programs per row tile in
    all. A function of the weight's shape only: a row's additions never depend on the rows beside
    it."""
    tiles = math.ceil(k / TILE)
    chunks = max(1, min(tiles // CHUNK_TILES, SPLIT_PROGRAMS // math.ceil(n / TILE)))
    return math.ceil(tiles / chunks)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear: x [..., K] times weight [N, K] transposed, plus bias [N], in x's dtype."""
    k, n = x.shape[-1], weight.shape[0]
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    chunk = k_chunks(n, k)
    splits = triton.cdiv(k, chunk * TILE)
    # float32 partials, one [M, N] per chunk, added in order by _sum_chunks_kernel
    parts = out if splits == 1 else torch.empty(splits, m, n, device=x.device)
    bias_or_any = weight if bias is None else bias
    _linear_kernel[(triton.cdiv(m, TILE), triton.cdiv(n, TILE), splits)](
        flat, weight, bias_or_any, parts, m, n, k, flat.stride(0), flat.stride(1),
        weight.stride(0), weight.stride(1), n if splits > 1 else out.stride(0), m * n,
        HAS_BIAS=bias is not None and splits == 1, SPLIT=splits > 1, CHUNK=chunk * TILE,
        TILE=TILE, PRECISION=precision(x.dtype), num_warps=4, num_stages=3,
    )  # fmt: skip
    if splits > 1:
        _sum_chunks_kernel[(triton.cdiv(m * n, 1024),)](
            parts, bias_or_any, out, m * n, n, splits, HAS_BIAS=bias is not None, BLOCK=1024
        )
    return out.view(*x.shape[:-1], n)


def rms_norm(x: Tensor, normalized_shape, weight: Tensor | None = None, eps=None) -> Tensor:
    """F.rms_norm over the last dim (eps None: the dtype's machine epsilon, as torch's)."""
    h = x.shape[-1]
    flat = x.reshape(-1, h).contiguous()  # (the kernel steps along a row one element at a time)
    out = torch.empty_like(flat)
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    _rms_norm_kernel[(flat.shape[0],)](
        flat, flat if weight is None else weight, out, h, flat.stride(0), out.stride(0), eps,
        HAS_WEIGHT=weight is not None, BLOCK=triton.next_power_of_2(h),
    )  # fmt: skip
    return out.view(x.shape)


def over_dims(reduce_rows, x: Tensor, dim, keepdim: bool) -> Tensor:
    """A row reduction (rows [R, n] -> [R]) over `dim` of x (a dim or several, as torch's
    reductions take it): those dims moved last and flattened into each row."""
    dims = sorted(d % x.dim() for d in (dim if isinstance(dim, (tuple, list)) else (dim,)))
    moved = x.movedim(dims, list(range(x.dim() - len(dims), x.dim())))
    kept = moved.shape[: x.dim() - len(dims)]
    out = reduce_rows(moved.reshape(-1, math.prod(x.shape[d] for d in dims))).view(kept)
    for d in dims if keepdim else ():
        out = out.unsqueeze(d)
    return out


def logsumexp(x: Tensor, dim, keepdim: bool = False) -> Tensor:
    """torch.logsumexp, accumulated in float32, in x's dtype (as torch's)."""
    return over_dims(_logsumexp_rows, x, dim, keepdim)


def _logsumexp_rows(rows: Tensor) -> Tensor:
    rows = rows.contiguous()  # (the kernel steps along a row one element at a time)
    out = torch.empty(rows.shape[0], device=rows.device, dtype=torch.float32)
    block = min(NORM_BLOCK, triton.next_power_of_2(rows.shape[1]))
    _logsumexp_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0), BLOCK=block)
    return out.to(rows.dtype)


def _fixed_output(x: Tensor, shape) -> Tensor:
    """A contiguous tensor of `shape` like x, for torch.compile's tracing (register_fake): what a
    kernel returns, without running it."""
    return x.new_empty(shape)


# The kernels as operators torch.compile can trace (opaque: inductor calls them as they are and
# fuses the elementwise work around them), so a batch-invariant decode step is compiled too.
if triton is not None:

    @torch.library.custom_op("keel::invariant_linear", mutates_args=())
    def linear_op(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return linear(x, weight, bias)

    @linear_op.register_fake
    def _(x, weight, bias=None):
        return _fixed_output(x, (*x.shape[:-1], weight.shape[0]))

    @torch.library.custom_op("keel::invariant_rms_norm", mutates_args=())
    def rms_norm_op(
        x: Tensor,
        normalized_shape: list[int],
        weight: Tensor | None = None,
        eps: float | None = None,
    ) -> Tensor:
        return rms_norm(x, normalized_shape, weight, eps)

    @rms_norm_op.register_fake
    def _(x, normalized_shape, weight=None, eps=None):
        return _fixed_output(x, x.shape)

    @torch.library.custom_op("keel::invariant_logsumexp", mutates_args=())
    def logsumexp_op(x: Tensor, dim: list[int], keepdim: bool = False) -> Tensor:
        return logsumexp(x, dim, keepdim)

    @logsumexp_op.register_fake
    def _(x, dim, keepdim=False):
        dims = {d % x.dim() for d in dim}
        shape = [1 if d in dims else size for d, size in enumerate(x.shape)]
        return _fixed_output(
            x, shape if keepdim else [s for d, s in enumerate(shape) if d not in dims]
        )


def attend(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Tensor, first: Tensor, last: Tensor
) -> Tensor:
    """invariant.attend on the GPU: q [N, H, D] over cache rows `rows` [N], columns `first` to
    `last` [N] inclusive -> [N, H, D]."""
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    _attend_kernel[(n, kv_heads)](
        q, k_cache, v_cache, out, rows, first, last, dim**-0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_GROUP=max(16, triton.next_power_of_2(group)), DIM=dim,
        BLOCK_DIM=max(16, triton.next_power_of_2(dim)), BLOCK=TILE, PRECISION=precision(q.dtype),
        num_warps=4,
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit(do_not_specialize=["m", "part"])
    def _linear_kernel(
        X, W, B, Out, m, n, k, x_m, x_k, w_n, w_k, out_m, part,
        HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        # (m, the number of rows, is not specialised on: one compiled kernel for every count)
        # int64 offsets: rows times a row's stride passes 2^31 in a long pass's wide matmuls
        rows = (tl.program_id(0) * TILE + tl.arange(0, TILE)).to(tl.int64)
        cols = (tl.program_id(1) * TILE + tl.arange(0, TILE)).to(tl.int64)
        chunk = tl.program_id(2)
        ks = tl.arange(0, TILE)
        acc = tl.zeros([TILE, TILE], tl.float32)
        end = tl.minimum(chunk * CHUNK + CHUNK, k)
        for k0 in range(chunk * CHUNK, end, TILE):
            a = tl.load(
                X + rows[:, None] * x_m + (k0 + ks)[None, :] * x_k,
                mask=(rows[:, None] < m) & ((k0 + ks)[None, :] < end),
                other=0.0,
            )
            b = tl.load(
                W + cols[None, :] * w_n + (k0 + ks)[:, None] * w_k,
                mask=(cols[None, :] < n) & ((k0 + ks)[:, None] < end),
                other=0.0,
            )
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(B + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
        # a chunk's float32 partial, or (one chunk) the output itself
        if SPLIT:
            out = acc
        else:
            out = acc.to(Out.dtype.element_ty)
        tl.store(
            Out + chunk.to(tl.int64) * part + rows[:, None] * out_m + cols[None, :],
            out,
            mask=(rows[:, None] < m) & (cols[None, :] < n),
        )

    @triton.jit(do_not_specialize=["size"])
    def _sum_chunks_kernel(
        Parts, B, Out, size, n, splits, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
    ):
        # the chunks' partials added first to last, then the bias: one order for every row
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = at < size
        total = tl.load(Parts + at, mask=inside, other=0.0)
        part = at
        for _ in range(1, splits):
            part += size
            total += tl.load(Parts + part, mask=inside, other=0.0)
        if HAS_BIAS:
            total += tl.load(B + at % n, mask=inside, other=0.0).to(tl.float32)
        tl.store(Out + at, total.to(Out.dtype.element_ty), mask=inside)

    @triton.jit
    def _rms_norm_kernel(
        X, W, Out, h, x_row, out_row, eps, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + row * x_row + cols, mask=cols < h, other=0.0).to(tl.float32)
        y = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / h + eps)
        if HAS_WEIGHT:
            y = y * tl.load(W + cols, mask=cols < h, other=0.0).to(tl.float32)
        tl.store(Out + row * out_row + cols, y.to(Out.dtype.element_ty), mask=cols < h)

    @triton.jit
    def _logsumexp_kernel(X, Out, v, x_row, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        top = tl.full([], float("-inf"), tl.float32)
        total = tl.zeros([], tl.float32)
        for start in range(0, v, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(X + row * x_row + cols, mask=cols < v, other=float("-inf")).to(tl.float32)
            new_top = tl.maximum(top, tl.max(x, axis=0))
            # while every entry so far is -inf, exp(-inf - -inf) would be NaN: nothing to add
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)
            total = total * tl.exp(top - shift) + tl.sum(tl.exp(x - shift), axis=0)
            top = new_top
        tl.store(Out + row, top + tl.log(total))

    @triton.jit
    def _attend_kernel(
        Q, KCache, VCache, Out, Rows, First, Last, scale,
        q_n, q_h, kc_r, kc_h, kc_l, vc_r, vc_h, vc_l, out_n, out_h,
        GROUP: tl.constexpr, BLOCK_GROUP: tl.constexpr, DIM: tl.constexpr,
        BLOCK_DIM: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # (a head of fewer than 16 dims is padded with zeros to tl.dot's least: products of 0)
        query = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        row = tl.load(Rows + query).to(tl.int64)
        first = tl.load(First + query)
        last = tl.load(Last + query)
        g = tl.arange(0, BLOCK_GROUP)
        d = tl.arange(0, BLOCK_DIM)
        heads = kv_head * GROUP + g
        in_head = d[None, :] < DIM
        in_group = (g < GROUP)[:, None] & in_head
        q = tl.load(Q + query * q_n + heads[:, None] * q_h + d[None, :], mask=in_group, other=0.0)
        k_base = KCache + row * kc_r + kv_head * kc_h
        v_base = VCache + row * vc_r + kv_head * vc_h
        top = tl.full([BLOCK_GROUP], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_GROUP], tl.float32)
        acc = tl.zeros([BLOCK_GROUP, BLOCK_DIM], tl.float32)
        # blocks counted from the query's first column: the same blocks in every pass
        for start in range(first, last + 1, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            seen = cols <= last
            rows = seen[:, None] & in_head
            k = tl.load(k_base + cols[:, None] * kc_l + d[None, :], mask=rows, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(seen[None, :], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, axis=1))
            rescale = tl.exp(top - new_top)
            p = tl.exp(scores - new_top[:, None])
            v = tl.load(v_base + cols[:, None] * vc_l + d[None, :], mask=rows, other=0.0)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            total = total * rescale + tl.sum(p, axis=1)
            top = new_top
        out = acc / total[:, None]
        tl.store(
            Out + query * out_n + heads[:, None] * out_h + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=in_group,
        )
