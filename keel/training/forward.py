"""Forward passes over `[prompt | response]` sequences: log-probs, entropy and values."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, partial
from typing import NamedTuple

import torch
from torch import Tensor

from keel.algorithms.utils import entropy_from_logits
from keel.models import families
from keel.training.batching import MicroBatching, micro_batches
from keel.training.placement import SINGLE, Placement
from keel.training.shared_prompt import shared_prompt_stats, shared_prompts_of
from keel.training.target_log_prob import target_log_probs
from keel.types import TrainBatch, pad_responses, position_ids_from_mask


def _model_inputs(batch: TrainBatch) -> dict[str, Tensor]:
    attention_mask = batch.attention_mask  # [B, P + R]
    return {
        "input_ids": batch.input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
    }


# Architectures whose logits are exactly lm_head(final hidden state): no soft-capping or scaling
# (Gemma 2, Cohere) that the chunked path below would skip. Each family's record says which of its
# model types are, and why the others are not (models/families.py).
PLAIN_LM_HEAD = set(families.PLAIN_LM_HEAD)
LOGITS_CHUNK_TOKENS = 1024  # [chunk, V] float32 logits at a time: 0.6 GB for a 151k vocabulary
# Where a micro-batch's logits fit the budget (logits_budget), backward keeps them rather than
# running lm_head again, and chunks are wider: fewer, larger launches.
# of the GPU's memory, and at most half of what is free
KEPT_LOGITS_SHARE = 0.1
KEPT_LOGITS_CHUNK_TOKENS = 4096
# Bytes per logit, measured under bf16 autocast. What backward keeps: the compiled vocabulary
# arithmetic its bf16 input (t1's peak rose 4.7 GB for 2.4G logits), eager float32 logits, and
# their softmax too when the entropy has a gradient. A chunk's working set while it is computed:
# eager's float copies and exponentials, or the compiled kernels' bf16 logits and float gradient.


class TopK(NamedTuple):
    """The k most likely tokens among the first `vocab` ids (a teacher whose embedding has rows
    past the student's: no id the student has no row for), their log-probs over every id."""

    k: int
    vocab: int | None = None


# What a pass over the vocabulary may add (distillation): None; the top k's log-probs and ids
# (TopK); the log-probs of given ids (a tensor of them, one row per position).
VocabExtra = TopK | Tensor | None
KEPT_BYTES = {"compiled": 2, "eager": 4, "entropy_grad": 8}
CHUNK_BYTES = {"compiled": 6, "eager": 16}


@dataclass(frozen=True)
class LogitsChunking:
    """How lm_head and the vocabulary arithmetic go over a micro-batch's positions."""

    # positions per chunk
    tokens: int
    # checkpointed: backward runs the chunk's lm_head again instead of keeping its logits
    recompute: bool


def logits_chunking(
    positions: int,
    vocab: int,
    device: torch.device,
    *,
    grad: bool,
    compiled: bool,
    entropy_grad: bool,
) -> LogitsChunking:
    """Chunked and recomputed (activation checkpointing) unless the whole micro-batch's kept logits
    and a wide chunk's working set fit logits_budget: at 0.5B lm_head is about a quarter of the
    model's matmul parameters, so recomputing it adds about 9% to the update's FLOPs, and each
    checkpointed chunk costs Python time. On CPU memory is not measured: always the small chunks."""
    if device.type != "cuda":
        return LogitsChunking(LOGITS_CHUNK_TOKENS, grad)
    budget = logits_budget(device)
    wide_chunk = KEPT_LOGITS_CHUNK_TOKENS * vocab * CHUNK_BYTES["compiled" if compiled else "eager"]
    kept = (
        positions
        * vocab
        * KEPT_BYTES["entropy_grad" if entropy_grad else "compiled" if compiled else "eager"]
    )
    if wide_chunk + (kept if grad else 0) > budget:
        return LogitsChunking(LOGITS_CHUNK_TOKENS, grad)
    return LogitsChunking(KEPT_LOGITS_CHUNK_TOKENS, False)


def logits_budget(device: torch.device) -> float:
    """Bytes that kept logits and wide chunks may take: KEPT_LOGITS_SHARE of the GPU, and at most
    half of what is free now (on the device, or cached by torch's allocator and unused), so a run
    near its memory keeps the small recomputed chunks."""
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return min(KEPT_LOGITS_SHARE * total, free / 2)


def compute_device(model, plan: Placement = SINGLE) -> torch.device:
    """Where the model computes: its parameters' device, unless they are offloaded to CPU."""
    return plan.device or next(model.parameters()).device


def response_log_probs(
    model,
    batch: TrainBatch,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    plan: Placement = SINGLE,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs [B, R] of the response tokens, and their entropy [B, R] when asked.

    Position t predicts token t + 1, so positions P-1 .. P+R-2 predict the R response tokens. For
    plain architectures the [B, R, V] float32 logits never exist at once: `lm_head` runs on chunks
    of positions, each recomputed in backward (activation checkpointing) unless the micro-batch's
    logits are small beside the GPU's memory (logits_chunking), so memory holds only the [B, R, H]
    hidden states. Other models go through `logits_to_keep`.
    """
    log_probs, entropy, _ = response_vocab_stats(
        model, batch, temperature, with_entropy, entropy_grad, plan
    )
    return log_probs, entropy


def response_vocab_stats(
    model,
    batch: TrainBatch,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    plan: Placement = SINGLE,
    vocab_extra: VocabExtra = None,
    host_batch: TrainBatch | None = None,
) -> tuple[Tensor, Tensor | None, tuple[Tensor, ...]]:
    """response_log_probs, and what `vocab_extra` asks of each response position's distribution
    (distillation): TopK(k), the k most likely tokens' log-probs [B, R, k] and ids [B, R, k]; ids
    [B, R, k], the log-probs of those tokens [B, R, k]. () when None. `host_batch`: the batch as
    the host holds it, where `batch` is already on the device (shared prompts are laid out from
    it)."""
    plain = getattr(model.config, "model_type", None) in PLAIN_LM_HEAD
    device = compute_device(model, plan)
    token_stats = plan.token_stats or partial(
        decoder_token_stats, model, fused_vocab=plan.fused_vocab
    )
    # laid out from the host's copy; the batch itself is then not moved
    shared = shared_prompts_of(host_batch or batch, model.config) if plain else None
    if shared is not None:
        return shared_prompt_stats(
            token_stats, shared.to(device), model.config, temperature, with_entropy, entropy_grad,
            vocab_extra,
        )  # fmt: skip
    batch = batch.to(device)
    inputs = _model_inputs(batch)
    targets = batch.response_ids  # [B, R]
    if isinstance(vocab_extra, Tensor):
        vocab_extra = vocab_extra.to(targets.device)
    if not plain:
        out = model(**inputs, use_cache=False, logits_to_keep=targets.shape[1] + 1)
        return _token_stats(
            out.logits[:, :-1], targets, temperature, with_entropy, entropy_grad, vocab_extra
        )
    return token_stats(
        inputs, targets, temperature, with_entropy, entropy_grad, vocab_extra=vocab_extra
    )


def decoder_token_stats(
    model,
    inputs: dict[str, Tensor],
    targets: Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    fused_vocab: bool = False,
    vocab_extra: VocabExtra = None,
    predict_at: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, tuple[Tensor, ...]]:
    """`predict_at` (shared prompts): the flat positions that predict `targets` [T], whose
    log-probs, entropy and extras come back flat [T, ...] (ids in `vocab_extra` [T, k]); else
    those of the responses [B, R, ...]."""
    hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
    lm_head = model.get_output_embeddings()
    if predict_at is not None:
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])[predict_at]
        return vocab_token_stats(
            lm_head, flat_hidden, targets, temperature, with_entropy, entropy_grad, fused_vocab,
            vocab_extra,
        )  # fmt: skip
    response_len = targets.shape[1]
    hidden = hidden[:, -response_len - 1 : -1]  # [B, R, H]
    # [B*R, H], [B*R]
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if isinstance(vocab_extra, Tensor):
        vocab_extra = vocab_extra.reshape(flat_targets.shape[0], -1)  # [B*R, k]
    log_probs, entropy, extras = vocab_token_stats(
        lm_head,
        flat_hidden,
        flat_targets,
        temperature,
        with_entropy,
        entropy_grad,
        fused_vocab,
        vocab_extra,
    )
    # Reshaped copies, not views: FSDP hooks the outputs of a forward method for backward.
    log_probs = log_probs.reshape(targets.shape).clone()
    entropy = entropy.reshape(targets.shape).clone() if with_entropy else None
    extras = tuple(e.reshape(*targets.shape, -1).clone() for e in extras)
    return log_probs, entropy, extras


def vocab_token_stats(
    lm_head,
    flat_hidden: Tensor,
    flat_targets: Tensor,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    fused_vocab: bool = False,
    vocab_extra: VocabExtra = None,
) -> tuple[Tensor, Tensor | None, tuple[Tensor, ...]]:
    """Log-probs [N] of the targets [N] from hidden states [N, H], their entropy [N] when asked,
    and what `vocab_extra` asks (response_vocab_stats): lm_head and the vocabulary arithmetic run
    on chunks of positions (logits_chunking)."""
    token_stats = _compiled_token_stats() if fused_vocab else _token_stats
    chunking = logits_chunking(
        flat_targets.shape[0],
        lm_head.weight.shape[0],
        flat_hidden.device,
        grad=torch.is_grad_enabled(),
        compiled=fused_vocab,
        entropy_grad=with_entropy and entropy_grad,
    )
    parts = []
    for start in range(0, flat_targets.shape[0], chunking.tokens):
        chunk = slice(start, start + chunking.tokens)
        extra = vocab_extra[chunk] if isinstance(vocab_extra, Tensor) else vocab_extra
        args = (
            lm_head,
            token_stats,
            flat_hidden[chunk],
            flat_targets[chunk],
            temperature,
            with_entropy,
            entropy_grad,
            extra,
        )
        if chunking.recompute:
            parts.append(
                torch.utils.checkpoint.checkpoint(_chunk_stats, *args, use_reentrant=False)
            )
        else:
            parts.append(_chunk_stats(*args))
    log_probs = torch.cat([part[0] for part in parts])
    entropy = torch.cat([part[1] for part in parts]) if with_entropy else None
    extras = tuple(torch.cat([part[2 + i] for part in parts]) for i in range(len(parts[0]) - 2))
    return log_probs, entropy, extras


def _chunk_stats(
    lm_head,
    token_stats,
    hidden: Tensor,
    targets: Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    vocab_extra: VocabExtra = None,
) -> tuple[Tensor, ...]:
    """(log-probs, entropy or zeros, *what vocab_extra asked): flat, as checkpoint returns them."""
    log_probs, entropy, extras = token_stats(
        lm_head(hidden), targets, temperature, with_entropy, entropy_grad, vocab_extra
    )
    return log_probs, entropy if entropy is not None else torch.zeros_like(log_probs), *extras


@cache
def _compiled_token_stats():
    """_token_stats fused by torch.compile (`actor.use_torch_compile`, GPU only): the float cast,
    logsumexp, gather and entropy become a few passes over the [chunk, V] logits instead of one
    each, forward and backward. Compiled once per process."""
    return torch.compile(_token_stats)


def _token_stats(
    logits: Tensor,
    targets: Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    vocab_extra: VocabExtra = None,
) -> tuple[Tensor, Tensor | None, tuple[Tensor, ...]]:
    """Log-prob of each target, the entropy, and what `vocab_extra` asks (response_vocab_stats),
    from logits [..., V] scaled by temperature.

    z[target] - logsumexp(z) rather than a full log_softmax: the [tokens, V] logits are the
    largest tensors of the update, and every pass over them counts."""
    if vocab_extra is None and not (with_entropy and entropy_grad):
        # the common case: a backward that writes the logits' gradient in one pass
        log_probs, entropy = target_log_probs(logits, targets, temperature, with_entropy)
        return log_probs, entropy, ()
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)  # [...]
    log_probs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        entropy = (
            entropy_from_logits(logits, lse)
            if entropy_grad
            else entropy_from_logits(logits.detach(), lse.detach())
        )
    extras = ()
    if isinstance(vocab_extra, Tensor):  # ids [..., k]: their log-probs
        extras = (logits.gather(-1, vocab_extra) - lse.unsqueeze(-1),)
    elif vocab_extra is not None:  # TopK: the k most likely tokens' log-probs and ids
        k, vocab = vocab_extra
        kept = logits[..., :vocab]
        top = kept.topk(min(k, kept.shape[-1]), dim=-1)
        extras = (top.values - lse.unsqueeze(-1), top.indices)
    return log_probs, entropy, extras


def response_values(critic, batch: TrainBatch, plan: Placement = SINGLE) -> Tensor:
    """Critic values [B, R]: the value of the state before each response token."""
    batch = batch.to(compute_device(critic, plan))
    response_len = batch.response_ids.shape[1]
    values = critic(**_model_inputs(batch))  # [B, P + R]
    return values[:, -response_len - 1 : -1].float()


def per_token_outputs(batch: TrainBatch, how: MicroBatching, compute) -> Tensor:
    """`compute(micro)` -> [b, r] for every micro-batch, put back in batch order and width: [N, R]
    (fillers' outputs dropped, padding zeroed)."""
    return per_token_parts(batch, how, lambda micro: (compute(micro),))[0]


def per_token_parts(batch: TrainBatch, how: MicroBatching, compute) -> list[Tensor]:
    """`compute(micro)` -> a tuple of [b, r, ...] tensors for every micro-batch, each put back in
    batch order and width: [N, R, ...] on the host (floating ones as float32; fillers' outputs
    dropped, padding zeroed)."""
    # Every micro-batch is launched before any result is read, and the results come to the host in
    # one copy each: the host waits for the GPU once, and has little left to do once it has waited.
    # Fillers (no rows) run too: every rank makes the same forward passes.
    width = batch.response_ids.shape[1]
    results = [
        (rows, [pad_responses(t, width) for t in compute(micro)])
        for rows, micro in micro_batches(batch, how)
    ]
    # a rank may hold fillers only: their outputs give the shapes
    shapes = results[0][1]
    results = [(rows, values) for rows, values in results if len(rows)]
    order = torch.cat([rows for rows, _ in results]) if results else torch.zeros(0, dtype=int)
    outputs = []
    for i, like in enumerate(shapes):
        dtype = torch.float32 if like.is_floating_point() else like.dtype
        out = torch.zeros((len(batch), *like.shape[1:]), dtype=dtype)
        if results:
            out[order] = torch.cat([values[i] for _, values in results]).to(dtype).cpu()
        mask = batch.response_mask.reshape(*batch.response_mask.shape, *[1] * (out.dim() - 2))
        outputs.append(out * mask.to(dtype))
    return outputs


@torch.no_grad()
def batched_log_probs(
    model, batch: TrainBatch, how: MicroBatching, temperature: float, plan: Placement = SINGLE
) -> Tensor:
    """Log-probs for a whole batch without gradients, micro-batch by micro-batch: [N, R]."""
    was_training = model.training
    model.eval()
    try:
        return per_token_outputs(
            batch, how, lambda micro: response_log_probs(model, micro, temperature, plan=plan)[0]
        )
    finally:
        model.train(was_training)
