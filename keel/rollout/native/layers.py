"""The decoder layer's shared math, as pure functions over plain tensors (RMSNorm, rotary
embeddings, grouped-query attention, a gated SiLU MLP; a family in models/ picks and adds to them),
and the decode step's functions compiled once by torch.compile where it can fuse them."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from keel.rollout.native.attention import attention_with_sinks
from keel.rollout.native.sampling import Pickers, pick_blocked, pick_token

RECOMPILE_LIMIT = 64
# LoRA's (A [r, in], B [out, r] times its scaling) of one projection
LowRank = tuple[Tensor, Tensor]


class StepFunctions:
    """The pure parts of a decode step, compiled by torch.compile where it can fuse them (CUDA
    with Triton; fullgraph, so a graph break is an error), plain functions elsewhere (CPU, or
    `rollout.enforce_eager`, and prefill). A family's layer functions (models/) are among them."""

    def __init__(
        self,
        family,
        compiled: bool,
        mode: str | None = None,
        exact: bool = False,
        rotary_in_attention: bool = False,
        programmatic: bool = False,
    ):
        """`rotary_in_attention`: the attention kernel norms and rotates the query and key heads
        itself (attention.Rotary), so `projection` replaces `attention_inputs`: the projection,
        its heads as they are. `programmatic`: inductor's kernels take Hopper's programmatic
        dependent launch (runner.PROGRAMMATIC_LAUNCH)."""
        if compiled:
            # Each batch bucket, cache length and dtype is a compiled variant of these few
            # functions; past dynamo's default of 8, fullgraph=True would make a recompile a hard
            # failure.
            torch._dynamo.config.recompile_limit = max(
                torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT
            )

        # exact (rollout.batch_invariant): each intermediate rounded to its dtype as eager rounds
        # it, and one graph for every shape, so a value's bits do not depend on which ops inductor
        # fused at a given batch or length
        options = {"emulate_precision_casts": True} if exact else {}
        if programmatic:
            options["triton.enable_pdl"] = True
        dynamic = True if exact else None

        if mode is not None and options:
            # torch.compile takes a mode or options, not both: the mode as its options
            options, mode = {**torch._inductor.list_mode_options(mode), **options}, None

        def prepared(fn):
            if not compiled:
                return fn
            return torch.compile(
                fn, fullgraph=True, mode=mode, dynamic=dynamic, options=options or None
            )

        self.step_inputs = prepared(step_inputs)
        self.rope = prepared(rope)
        self.norm = prepared(family.norm)
        self.attention_inputs = prepared(family.attention_inputs)
        self.projection = prepared(projected_heads) if rotary_in_attention else None
        self.after_attention = {kind: prepared(fn) for kind, fn in family.after_attention.items()}
        self.pickers = Pickers(prepared(pick_token), prepared(pick_blocked))


def step_inputs(
    last_token: Tensor,
    pad: Tensor,
    column: Tensor,
    cache_len: int,
    embed: Tensor,
    embed_scale: float,
    stream_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """Embeddings [B, hidden] in the residual stream's dtype (times the family's scale), each row's
    position [B] (left padding skipped) and the visible cache columns [B, 1, 1, L]. `column`: the
    cache column of this step's token, one for the batch [1] or each row's own [B]."""
    positions = column - pad  # [B]
    cols = torch.arange(cache_len, device=pad.device)
    visible = ((cols >= pad[:, None]) & (cols <= column[:, None]))[:, None, None]  # [B, 1, 1, L]
    return embeddings(last_token, embed, embed_scale, stream_dtype), positions, visible


def embeddings(ids: Tensor, embed: Tensor, embed_scale: float, stream_dtype: torch.dtype) -> Tensor:
    """The residual stream's start: the tokens' embeddings in its dtype, times the family's
    scale."""
    return F.embedding(ids, embed).to(stream_dtype) * embed_scale


def project(
    x: Tensor, weight: Tensor, low_rank: LowRank | None, bias: Tensor | None = None
) -> Tensor:
    """x W^T + b, plus LoRA's update x A^T B^T when adapters are on (B carries the scaling):
    unmerged, as the trainer computes it, so the base stays the trainer's frozen weights. x is
    cast to the weight's dtype first, as autocast casts a float32 stream's matmul inputs."""
    x = x.to(weight.dtype)
    y = F.linear(x, weight, bias)
    if low_rank is None:
        return y
    a, b = low_rank
    return y + F.linear(F.linear(x, a), b)


class AttentionArgs(NamedTuple):
    """What a layer's attention-inputs function takes after h, cos and sin: the layer's tensors
    (None where its family has none), then the family's constants, each named as the LayerWeights
    field or the Family attribute it is (models/base.layer_args fills them by name). A tuple of
    plain tensors, not the LayerWeights, so torch.compile guards on their shapes and every layer
    shares one graph."""

    qkv: Tensor  # [(H + 2 KV) * D, hidden]
    qkv_bias: Tensor | None
    qkv_lora: LowRank | None
    # each head's query and key norm [D] (Qwen3, Gemma 3), or the whole projection's (OLMo 2)
    q_norm: Tensor | None
    k_norm: Tensor | None
    heads: int
    kv_heads: int
    eps: float
    # Gemma 3: the queries times this, so that the kernels' 1/sqrt(D) makes query_pre_attn_scalar's
    query_scale: float


class MlpArgs(NamedTuple):
    """What a dense layer's after-attention function takes after x, the attention and the next
    norm: the output projection, the norms around the MLP (each family reads those it has), the
    gated MLP, LoRA's adapters of each projection (None: off), then eps; named as AttentionArgs'."""

    o: Tensor
    # after the attention: before the MLP (Llama), or on the attention's output (OLMo 2, Gemma 3)
    post_norm: Tensor
    # Gemma 3: before the MLP
    pre_mlp_norm: Tensor | None
    gate_up: Tensor  # [2 * intermediate, hidden]
    down: Tensor
    # OLMo 2, Gemma 3: on the MLP's output
    post_mlp_norm: Tensor | None
    o_lora: LowRank | None
    gate_up_lora: LowRank | None
    down_lora: LowRank | None
    eps: float


def attention_inputs(
    h: Tensor, cos: Tensor, sin: Tensor, args: AttentionArgs
) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, H, 1, D] and k [B, KV, 1, D] rotated, v [B, KV, 1, D], from the normed hidden state;
    each head's query and key RMS-normed first where the layer has those norms (Qwen3)."""
    batch, head_dim, heads = h.shape[0], cos.shape[-1], args.heads
    qkv = project(h, args.qkv, args.qkv_lora, args.qkv_bias)
    kv_size = args.kv_heads * head_dim
    qk = qkv[:, :-kv_size].view(batch, heads + args.kv_heads, head_dim)
    if args.q_norm is not None:
        qk = torch.cat(
            [
                rms_norm(qk[:, :heads], args.q_norm, args.eps),
                rms_norm(qk[:, heads:], args.k_norm, args.eps),
            ],
            dim=1,
        )
    qk = applyrope(qk, cos, sin)
    v = qkv[:, -kv_size:].view(batch, args.kv_heads, 1, head_dim)
    # rotated in float32 where the stream is (its cos and sin are): rounded once
    qk = qk.to(qkv.dtype)
    return qk[:, :heads].unsqueeze(2), qk[:, heads:].unsqueeze(2), v


def projected_heads(h: Tensor, args: AttentionArgs) -> tuple[Tensor, Tensor, Tensor]:
    """attention_inputs' projection alone: q [B, H, 1, D], k and v [B, KV, 1, D], views of it
    as they are (not normed, not rotated), for a kernel that does the rest (attention.Rotary)."""
    batch, heads, kv_heads = h.shape[0], args.heads, args.kv_heads
    qkv = project(h, args.qkv, args.qkv_lora, args.qkv_bias)
    q, k, v = qkv.view(batch, heads + 2 * kv_heads, 1, -1).split([heads, kv_heads, kv_heads], 1)
    return q, k, v


def attention_output_and_mlp(
    x: Tensor, attention: Tensor, next_norm: Tensor, args: MlpArgs
) -> tuple[Tensor, Tensor]:
    """The rest of a decoder layer: output projection and residual, the gated MLP and residual;
    also the next layer's normed input, so the residual stream is read once. That input is
    returned in the projections' dtype: their matmuls round it to that anyway (`project`, and the
    output layer's), and here the rounding fuses into the norm's kernel instead of being one more
    kernel per layer before the next projection."""
    x = residual_add(x, project(attention, args.o, args.o_lora))
    normed = rms_norm(x, args.post_norm, args.eps)
    gate, up = project(normed, args.gate_up, args.gate_up_lora).chunk(2, dim=-1)
    x = residual_add(x, project(F.silu(gate) * up, args.down, args.down_lora))
    return x, rms_norm(x, next_norm, args.eps).to(args.gate_up.dtype)


def residual_add(x: Tensor, y: Tensor) -> Tensor:
    """x + y, rounded as a 16-bit add rounds (both are exact in float32). Written in float32 so
    that inductor fuses the add into the norm that reads it, rather than into the matmul as
    `addmm`, whose beta-add first copies x into the output: one more kernel per residual."""
    return (x.float() + y.float()).to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """As Qwen2/Llama compute it: in float32, scaled by the weight in the input dtype."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rope(
    positions: Tensor, inv_freq: Tensor, scale: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos [B, 1, D] and sin [B, 1, D] with the rotate-half sign folded in (-sin on the first
    half)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [B, D/2]
    cos = torch.cat([freqs, freqs], dim=-1).cos() * scale
    sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1) * scale
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def applyrope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, heads, D] rotated by its row's position: x cos + rotate_half(x) sin, where
    rotate_half(x) = [-x2, x1] and the minus sign lives in `sin`."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin


def grouped_attention(
    q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None, sinks: Tensor | None = None
) -> Tensor:
    """SDPA of q [u, H, L, D] over k, v [u, KV, S, D]: causal when `visible` is None, else under
    that mask. K/V are repeated to every query head, as transformers' SDPA path does: not every
    fused SDPA kernel that takes a mask also takes grouped heads (enable_gqa). With `sinks` [H]
    (GPT-OSS), each head's sink joins the softmax's normaliser, which SDPA cannot do."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if sinks is not None:
        return attention_with_sinks(q, k, v, visible, sinks.view(1, -1, 1, 1))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, is_causal=visible is None)


def within_window(
    visible: Tensor | None, query_columns: Tensor, end: int, window: int | None
) -> Tensor | None:
    """A prefill's mask narrowed to a sliding window: queries at cache columns `query_columns`
    ([L], or [u, L] each row's own) see keys no more than `window` - 1 columns back. `visible`:
    the mask without the window ([u, 1, L, end], or None for plain causal attention)."""
    if window is None or end <= window:
        return visible
    keys = torch.arange(end, device=query_columns.device)
    # [(u,) L, end]
    near = (keys > query_columns[..., None] - window) & (keys <= query_columns[..., None])
    near = near[:, None] if near.dim() == 3 else near
    return near if visible is None else visible & near


def window_start(pad: Tensor, column: Tensor, window: int | None) -> Tensor:
    """The first cache column a decoding row sees: past its padding, and within a sliding window."""
    return pad if window is None else torch.maximum(pad, column - window + 1)
