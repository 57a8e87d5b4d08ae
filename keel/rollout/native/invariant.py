"""Batch-invariant arithmetic (`rollout.batch_invariant`): every reduction a token's log-prob
depends on (the matmuls, the norms, attention, the vocabulary's logsumexp) is computed for one
token at a time, with the same shapes whatever else is in the batch, so a token's numbers do not
depend on its neighbours, on the batch's size, or on whether it was decoded one step at a time or
prefilled with its whole sequence. The sampler's log-probs and the old-log-prob pass (the engine's
prefill of the whole sequence, `NativeRolloutEngine.score`) are then bitwise equal: on-policy is
on-policy.

Why one token at a time: a fused kernel picks its tiling (and so its order of additions) by the
shape it is given; cuBLAS picks split-K by the number of rows, SDPA's kernels pick their blocks
by the query length, and a reduction kernel splits a row differently when there are few rows. A
vector product of one shape is one kernel with one order, whichever pass calls it. This is the
reference form, exact by construction and slow (a kernel per token and op); the same contract in
fixed-tile Triton kernels is what makes it fast.

RowInvariant is a TorchFunctionMode: inside it, the functions the native engine's layers call for
those reductions (F.linear, F.rms_norm, F.silu, SDPA, logsumexp, cos and sin) run row by row.
Elementwise arithmetic (adds, products, casts, gathers) is already the same for each element at
any shape, and is left as it is."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode


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
    """torch.logsumexp over the last dim, one row at a time."""
    if dim not in (-1, x.dim() - 1, (-1,), (x.dim() - 1,)):
        raise NotImplementedError("batch-invariant logsumexp reduces the last dim only")
    flat = rows_of(x, 1)
    out = torch.stack([torch.logsumexp(row, dim=0) for row in flat.unbind(0)])
    out = out.view(x.shape[:-1])
    return out.unsqueeze(-1) if keepdim else out


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """SDPA of q [..., L, D] over k, v [..., S, D] (heads matched, or grouped where q has a
    multiple of k's heads), one query at a time over exactly the keys it sees, in column order:
    scores, softmax and the weighted sum each a vector op whose shape is the number of keys the
    query sees. A decoding token and the same token in a prefill see the same keys, so they get the
    same bits; the masked columns a padded or static cache adds never enter. In float32, rounded to
    q's dtype once."""
    if dropout_p:
        raise NotImplementedError("batch-invariant attention has no dropout")
    length, keys, dim = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = dim**-0.5 if scale is None else scale
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-3] + (q.shape[-3],))
    queries = q.expand(*lead, length, dim).reshape(-1, length, dim)
    heads, kv_heads = q.shape[-3], k.shape[-3]
    group = heads // kv_heads
    k_rows = k.expand(*lead[:-1], kv_heads, keys, dim).reshape(-1, kv_heads, keys, dim)
    v_rows = v.expand(*lead[:-1], kv_heads, keys, v.shape[-1]).reshape(
        -1, kv_heads, keys, v.shape[-1]
    )
    if attn_mask is not None:
        mask = attn_mask.expand(*lead, length, keys).reshape(-1, length, keys)
    out = torch.empty(*queries.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    for i in range(queries.shape[0]):
        row, head = divmod(i, heads)
        k_head, v_head = k_rows[row, head // group], v_rows[row, head // group]
        for position in range(length):
            if attn_mask is None:
                # causal: the last query sees every key
                seen = torch.arange(keys - length + position + 1, device=q.device)
            else:
                seen = mask[i, position].nonzero().squeeze(-1)
            scores = torch.mv(k_head[seen].float(), queries[i, position].float()) * scale
            weights = torch.softmax(scores, dim=0)
            out[i, position] = torch.mv(v_head[seen].float().T.contiguous(), weights).to(q.dtype)
    if attn_mask is None and not is_causal and length > 1:
        raise NotImplementedError("batch-invariant attention needs a mask or is_causal")
    return out.view(*lead, length, v.shape[-1])


ROWWISE = {
    F.linear: linear,
    F.rms_norm: rms_norm,
    F.silu: rowwise(F.silu),
    torch.logsumexp: logsumexp,
    torch.Tensor.logsumexp: logsumexp,
    F.scaled_dot_product_attention: attention,
    torch.Tensor.cos: rowwise(torch.Tensor.cos),
    torch.Tensor.sin: rowwise(torch.Tensor.sin),
}


class RowInvariant(TorchFunctionMode):
    """Inside it, the reductions of ROWWISE run one row at a time (this module's docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # (the mode is off inside its own handler: the row functions call the originals)
        return ROWWISE.get(func, func)(*args, **kwargs)


def unsupported_reason(family) -> str | None:
    """Why this arithmetic cannot run a model of this family and config, or None: it covers dense
    decoders with full attention and a SiLU-gated MLP (Qwen2, Qwen3, Llama, Mistral, Phi-3,
    OLMo 2)."""
    if family.batch_invariant_blocker is not None:
        return family.batch_invariant_blocker
    if any(family.window(i) is not None for i in range(family.config.num_hidden_layers)):
        return "its sliding-window layers"
    return None
