"""Batch-invariant arithmetic (`rollout.batch_invariant`): every reduction a token's log-prob
depends on (the matmuls, the norms, attention, the vocabulary's logsumexp) is computed for one
token at a time, with the same shapes whatever else is in the batch, so a token's numbers do not
depend on its neighbours, on the batch's size, or on whether it was decoded one step at a time or
prefilled with its whole sequence. The sampler's log-probs and the old-log-prob pass (the engine's
prefill of the whole sequence, scoring.py) are then bitwise equal: on-policy is on-policy.

Why one token at a time: a fused kernel picks its tiling (and so its order of additions) by the
shape it is given; cuBLAS picks split-K by the number of rows, SDPA's kernels pick their blocks
by the query length, and a reduction kernel splits a row differently when there are few rows. A
vector product of one shape is one kernel with one order, whichever pass calls it: the reference
form here, exact by construction and slow (a kernel per token and op), which runs on CPU. On a GPU
the same contract is kept by fixed-tile Triton kernels (invariant_kernels.py).

RowInvariant is a TorchFunctionMode: inside it, the functions the native engine's layers call for
those reductions (F.linear, F.rms_norm, logsumexp) run row by row, and `attend` is the attention
of both passes. Elementwise arithmetic (adds, products, casts, gathers) is the same for each
element at any shape, and is left as it is (on CPU the transcendental ones run row by row too)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from keel.rollout.native import invariant_kernels
from keel.rollout.native.attention import write_new_token


def rows_of(x: Tensor, keep: int) -> Tensor:
    """x viewed as [rows, *its last `keep` dims] (rows: the product of the others)."""
    return x.reshape(-1, *x.shape[x.dim() - keep :])


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, one input row at a time (each a matrix-vector product of one shape)."""
    flat = rows_of(x, 1)
    out = torch.stack([F.linear(row, weight, bias) for row in flat.unbind(0)])
    return out.view(*x.shape[:-1], weight.shape[0])


def rms_norm(x: Tensor, normalized_shape, weight=None, eps=None) -> Tensor:
    """F.rms_norm over the last dim, one row at a time."""
    flat = rows_of(x, 1)
    out = torch.stack([F.rms_norm(row, normalized_shape, weight, eps) for row in flat.unbind(0)])
    return out.view(x.shape)


def rowwise(fn):
    """An elementwise function applied one last-dim row at a time: on CPU a vectorised loop's
    scalar tail (where a row lands at a chunk's end) may round a transcendental differently."""

    def apply(x: Tensor, *args, **kwargs) -> Tensor:
        flat = rows_of(x, 1)
        return torch.stack([fn(row, *args, **kwargs) for row in flat.unbind(0)]).view(x.shape)

    return apply


def logsumexp(x: Tensor, dim, keepdim: bool = False) -> Tensor:
    """torch.logsumexp, one row at a time."""
    return invariant_kernels.over_dims(_logsumexp_rows, x, dim, keepdim)


def _logsumexp_rows(rows: Tensor) -> Tensor:
    return torch.stack([torch.logsumexp(row, dim=0) for row in rows.unbind(0)])


def attend_reference(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Tensor, first: Tensor, last: Tensor
) -> Tensor:
    """attend, one query and head at a time: scores, softmax and the weighted sum each a vector op
    whose shape is the number of columns the query sees, in float32, rounded to q's dtype once."""
    heads, dim = q.shape[1], q.shape[2]
    group = heads // k_cache.shape[1]
    out = torch.empty_like(q)
    for n, (row, lo, hi) in enumerate(zip(rows.tolist(), first.tolist(), last.tolist())):
        for head in range(heads):
            keys = k_cache[row, head // group, lo : hi + 1].float()
            values = v_cache[row, head // group, lo : hi + 1].float()
            weights = torch.softmax(torch.mv(keys, q[n, head].float()) * dim**-0.5, dim=0)
            out[n, head] = torch.mv(values.T.contiguous(), weights).to(q.dtype)
    return out


def attend(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Tensor, first: Tensor, last: Tensor
) -> Tensor:
    """Attention of queries q [N, H, D] over the KV cache [rows, KV, L, D] (grouped heads): query
    n over cache row rows[n], columns first[n] to last[n] inclusive, exactly those and in column
    order, so a decoding token and the same token in a prefill get the same bits. -> [N, H, D]."""
    if q.is_cuda and invariant_kernels.triton is not None:
        return invariant_kernels.attend(q, k_cache, v_cache, rows, first, last)
    return attend_reference(q, k_cache, v_cache, rows, first, last)


# the reference, on CPU: elementwise functions too, where a vectorised loop's tail may round a
# transcendental otherwise
ROWWISE = {
    F.linear: linear,
    F.rms_norm: rms_norm,
    F.silu: rowwise(F.silu),
    torch.logsumexp: logsumexp,
    torch.Tensor.logsumexp: logsumexp,
    torch.Tensor.cos: rowwise(torch.Tensor.cos),
    torch.Tensor.sin: rowwise(torch.Tensor.sin),
}


def _linear_op(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return torch.ops.keel.invariant_linear(x, weight, bias)


def _rms_norm_op(x: Tensor, normalized_shape, weight=None, eps=None) -> Tensor:
    return torch.ops.keel.invariant_rms_norm(x, list(normalized_shape), weight, eps)


def _logsumexp_op(x: Tensor, dim, keepdim: bool = False) -> Tensor:
    dims = list(dim) if isinstance(dim, (tuple, list)) else [dim]
    return torch.ops.keel.invariant_logsumexp(x, dims, keepdim)


# On a GPU: fixed-tile kernels, as operators torch.compile traces (invariant_kernels). Elementwise
# work is the same for each element at any shape, eager or compiled, so long as both passes run it
# the same way: the runner gives prefill the decode step's compiled functions.
KERNELS = (
    {
        F.linear: _linear_op,
        F.rms_norm: _rms_norm_op,
        torch.logsumexp: _logsumexp_op,
        torch.Tensor.logsumexp: _logsumexp_op,
    }
    if invariant_kernels.triton is not None
    else {}
)
# (a plain bool: the handler is traced, and tests it)
HAVE_KERNELS = len(KERNELS) > 0


class RowInvariant(TorchFunctionMode):
    """Inside it, the reductions the layers call run in batch-invariant arithmetic: the GPU's
    kernels (KERNELS) on CUDA tensors, the row-at-a-time reference (ROWWISE) elsewhere."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # (the mode is off inside its own handler: these call the originals)
        kwargs = {} if kwargs is None else kwargs
        # a CUDA machine without Triton takes the references below, never plain cuBLAS
        if HAVE_KERNELS and len(args) > 0 and isinstance(args[0], Tensor) and args[0].is_cuda:
            # Traced by torch.compile (the decode step is compiled): identity tests only, where
            # torch 2.11's dynamo cannot take the truth of a tuple
            for reduction, kernel in KERNELS.items():
                if func is reduction:
                    return kernel(*args, **kwargs)
            return func(*args, **kwargs)
        return ROWWISE.get(func, func)(*args, **kwargs)


def decode_attention(
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
    prefix=None,
) -> Tensor:
    """The runner's decode attention (attention.sdpa_decode_attention's signature) in this
    arithmetic: the new token's K and V written at `column`, then `attend` over the columns from
    the row's first (`pad`) to it, every column read in the row's own cache (`prefix` is not
    used) -> [B, H * D]."""
    batch, heads, _, dim = q.shape
    write_new_token(k, v, k_cache, v_cache, column, rows)
    rows = torch.arange(batch, device=q.device) if rows is None else rows
    last = column.expand(batch).contiguous()
    attention = attend(q.view(batch, heads, dim), k_cache, v_cache, rows, pad, last)
    return attention.view(batch, heads * dim)


def unsupported_reason(family) -> str | None:
    """Why this arithmetic cannot run a model of this family and config, or None: it covers dense
    decoders with full attention and a SiLU-gated MLP (Qwen2, Qwen3, Llama, Mistral, Phi-3,
    OLMo 2)."""
    if family.batch_invariant_blocker is not None:
        return family.batch_invariant_blocker
    if any(family.window(i) is not None for i in range(family.config.num_hidden_layers)):
        return "its sliding-window layers"
    return None
