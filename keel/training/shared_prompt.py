"""A micro-batch's samples of one prompt computed with their prompt once.

GRPO draws n responses to each prompt, and the trainer's passes (old log-probs, reference, the
update's forward and backward) computed each sample's [prompt | response] whole: the prompt's
tokens n times over. Here the samples whose prompts are the same tokens form a block, one row:
the prompt once, then each response at the positions that follow it, with a mask that lets a
response see the prompt and itself, never another response. Every token's hidden state is the one
its own sequence gives, so the log-probs are the unshared pass's (to float rounding); at t1's
shapes (256-token prompts and responses, 8 samples a prompt) a micro-batch of whole groups computes
9 tokens a sample's 16 before.

The mask is flex attention's on a GPU (a block mask: the blocks a response never sees are skipped,
so attention does less work than the n sequences did) and a dense boolean one through SDPA on the
CPU, whose flex attention has no backward. SHARE_PROMPTS turns it on (off until measured on a GPU:
benchmarks/levers.py shareprompt). DPO's layout of a pair (pair_layout.py) masks by the same
rule."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

SHARE_PROMPTS = False

# each token's segment in its block: the prompt, the block's k-th response (k >= 0), or padding
PROMPT, PADDING = -1, -2
# flex attention's tile (queries and keys): its block mask lists, per query tile, the key tiles
# seen in part and those seen whole
FLEX_TILE = 128
# mask elements made at once while sorting the tiles
MASK_ELEMENTS = 1 << 26
# transformers' name for keel's flex attention function (flex_attention_forward)
KEEL_FLEX = "keel_flex"


@dataclass(frozen=True)
class SharedPrompts:
    """A micro-batch laid out as blocks, one a row, and where its targets are read and go."""

    input_ids: Tensor  # [rows, L]
    position_ids: Tensor  # [rows, L]
    segments: Tensor  # [rows, L]
    # [T] per response token: the flat index into [rows * L] of the position that predicts it,
    # the token, and its flat index into the micro-batch's [B * R]
    predict_at: Tensor
    targets: Tensor
    scatter_to: Tensor
    # the micro-batch's [B, R]
    shape: tuple[int, int]

    def to(self, device: torch.device) -> SharedPrompts:
        names = ("input_ids", "position_ids", "segments", "predict_at", "targets", "scatter_to")
        moved = {name: getattr(self, name).to(device, non_blocking=True) for name in names}
        return replace(self, **moved)

    def mask(self, flex: bool):
        """Flex attention's block mask, or a dense [rows, 1, L, L] boolean mask for SDPA."""
        if flex:
            return self._block_mask()
        index = torch.arange(self.segments.shape[1], device=self.segments.device)
        return allowed(self.segments, index[:, None], index[None, :])[:, None]

    def _block_mask(self):
        """Flex attention's block mask, its tiles sorted from the mask a few query tiles at a
        time: create_block_mask would evaluate all [rows, L, L] of it at once, tens of GB at
        long responses."""
        from torch.nn.attention.flex_attention import BlockMask

        length = self.segments.shape[1]
        tiles = -(-length // FLEX_TILE)
        # to whole tiles, so the kernel's last partial tile reads segments within the tensor
        segments = F.pad(self.segments, (0, tiles * FLEX_TILE - length), value=PADDING)
        some, every = _seen_tiles(segments)

        # indexed [row, position] by tensors: an ellipsis with flex's 0-d indices asks for their
        # values as Python ints, which its compiled mask cannot give
        def mask_mod(row, head, query, key):
            return _sees(segments[row, query], segments[row, key], query, key)

        return BlockMask.from_kv_blocks(
            *_tile_lists(some & ~every),
            *_tile_lists(every),
            BLOCK_SIZE=FLEX_TILE,
            mask_mod=mask_mod,
            seq_lengths=(length, length),
        )

    def scattered(self, values: Tensor) -> Tensor:
        """[T, ...] per target -> [B, R, ...], zero at the response positions that are padding."""
        flat = values.new_zeros(self.shape[0] * self.shape[1], *values.shape[1:])
        return flat.index_put((self.scatter_to,), values).view(*self.shape, *values.shape[1:])

    def per_target(self, values: Tensor) -> Tensor:
        """[B, R, ...] per response position -> [T, ...] per target."""
        return values.reshape(self.shape[0] * self.shape[1], *values.shape[2:])[self.scatter_to]


def _seen_tiles(segments: Tensor) -> tuple[Tensor, Tensor]:
    """Per row, query tile and key tile of `segments` [rows, tiles * FLEX_TILE]: whether some of
    its queries see some of its keys, and whether every query sees every key -> [rows, tiles,
    tiles] each. The mask is made MASK_ELEMENTS at a time."""
    rows, padded = segments.shape
    tiles = padded // FLEX_TILE
    index = torch.arange(padded, device=segments.device)
    step = max(1, MASK_ELEMENTS // (rows * FLEX_TILE * padded))
    some, every = [], []
    for first in range(0, tiles, step):
        query = index[first * FLEX_TILE : (first + step) * FLEX_TILE]
        seen = allowed(segments, query[:, None], index[None, :])  # [rows, queries, padded]
        seen = seen.view(rows, -1, FLEX_TILE, tiles, FLEX_TILE)
        some.append(seen.any(dim=4).any(dim=2))
        every.append(seen.all(dim=4).all(dim=2))
    return torch.cat(some, dim=1), torch.cat(every, dim=1)


def _tile_lists(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """[rows, tiles, tiles] -> flex attention's per query tile count of key tiles [rows, 1, tiles]
    and their indices, those first [rows, 1, tiles, tiles]."""
    count = tiles.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[:, None], order[:, None]


def allowed(segments: Tensor, query: Tensor, key: Tensor) -> Tensor:
    """Whether `query` sees `key` (positions of one row, whose tokens' segments are `segments`):
    an earlier or the same token of the prompt, or of the query's own response; a padding token
    sees only itself."""
    return _sees(segments[..., query], segments[..., key], query, key)


def _sees(own: Tensor, seen: Tensor, query: Tensor, key: Tensor) -> Tensor:
    """allowed, given the query's segment `own` and the key's `seen`."""
    shares = (seen == PROMPT) | (seen == own)
    return (query == key) | ((key <= query) & (own != PADDING) & shares)


def shared_prompts(input_ids: Tensor, attention_mask: Tensor, response_len: int):
    """The blocks of a micro-batch's rows [B, P + R] (prompts left-padded, responses right-padded,
    `attention_mask` 1 on real tokens; R = `response_len`) -> SharedPrompts, or None where no two
    samples have the same prompt, a prompt is empty (its first response token would have nothing
    to be predicted by) or every response is. Built on the host, in numpy: about a millisecond
    for t1's 64."""
    ids, real = input_ids.cpu().numpy(), attention_mask.cpu().numpy().astype(bool)
    width = ids.shape[1] - response_len
    prompts = [row[:width][keep[:width]] for row, keep in zip(ids, real)]
    # past each response's last real token
    lengths = (real[:, width:] * np.arange(1, response_len + 1)).max(-1, initial=0)
    blocks: dict[bytes, list[int]] = {}
    for sample, prompt in enumerate(prompts):
        blocks.setdefault(prompt.tobytes(), []).append(sample)
    empty = any(len(prompt) == 0 for prompt in prompts) or not lengths.any()
    if len(blocks) == len(prompts) or empty:
        return None
    built = [
        _block(prompts[members[0]], members, ids[:, width:], lengths, response_len)
        for members in blocks.values()
    ]
    return _rows(built, (len(prompts), response_len))


def _block(prompt, members: list[int], responses, lengths, width: int) -> list:
    """One block's tokens, positions and segments, and per response token (its predictor's offset
    in the block, the token, its flat index in [B * R]), as numpy arrays."""
    size, n = len(prompt), lengths[members]
    # each response's first offset in the block
    starts = size + np.concatenate([[0], np.cumsum(n)[:-1]])
    within = np.concatenate([np.arange(k) for k in n])  # each response token's index in its own
    member = np.repeat(np.arange(len(members)), n)
    sample = np.asarray(members)[member]
    targets = responses[sample, within]
    # the prompt's last token predicts a response's first; each response token the next
    predict = np.where(within == 0, size - 1, starts[member] + within - 1)
    return [
        np.concatenate([prompt, targets]),
        np.concatenate([np.arange(size), size + within]),
        np.concatenate([np.full(size, PROMPT), member]),
        predict,
        targets,
        sample * width + within,
    ]


def _rows(blocks: list[list], shape: tuple[int, int]) -> SharedPrompts:
    """One block a row, right-padded to the longest."""
    length = max(len(block[0]) for block in blocks)
    input_ids = np.zeros((len(blocks), length), dtype=np.int64)
    position_ids = np.zeros((len(blocks), length), dtype=np.int64)
    segments = np.full((len(blocks), length), PADDING, dtype=np.int64)
    for row, (tokens, positions, segment, *_) in enumerate(blocks):
        input_ids[row, : len(tokens)] = tokens
        position_ids[row, : len(tokens)] = positions
        segments[row, : len(tokens)] = segment
    predict_at = np.concatenate([row * length + block[3] for row, block in enumerate(blocks)])
    targets, scatter_to = (np.concatenate([block[i] for block in blocks]) for i in (4, 5))
    tensors = (input_ids, position_ids, segments, predict_at, targets, scatter_to)
    return SharedPrompts(*(torch.from_numpy(t.astype(np.int64)) for t in tensors), shape)


def can_share_prompt(config, length: int) -> bool:
    """Whether the shared prompt's mask holds for this model: a boolean 4-D mask means what it
    says to sdpa only (eager attention would add it to the scores, flash-attention refuses it);
    and it replaces the model's own masks, so a sliding window shorter than `length` (Gemma 3,
    Phi-3-mini) would be lost."""
    if getattr(config, "_attn_implementation", None) not in (None, "sdpa"):
        return False
    window = getattr(config, "sliding_window", None)
    if not window or window >= length:
        return True
    layer_types = getattr(config, "layer_types", None)
    return layer_types is not None and "sliding_attention" not in layer_types


def shared_prompts_of(batch, config) -> SharedPrompts | None:
    """The micro-batch's samples of one prompt laid out to compute it once, where that is on
    (SHARE_PROMPTS), the model's attention can take the mask, and the batch is on the host: one
    already on the device would make the host wait for its copy."""
    if not SHARE_PROMPTS or batch.prompt_ids.is_cuda:
        return None
    shared = shared_prompts(batch.input_ids, batch.attention_mask, batch.response_ids.shape[1])
    if shared is None or not can_share_prompt(config, shared.input_ids.shape[1]):
        return None
    if getattr(config, "attention_dropout", 0.0):  # flex attention has no dropout
        return None
    return shared


def shared_prompt_stats(
    token_stats,
    shared: SharedPrompts,
    config,
    temperature,
    with_entropy,
    entropy_grad,
    vocab_extra=None,
    flex: bool | None = None,
) -> tuple[Tensor, Tensor | None, tuple]:
    """response_vocab_stats over the blocks of `shared`: each target's log-prob (its entropy, what
    `vocab_extra` asks) read where its position is, put back in [B, R, ...]. `flex`: through flex
    attention (default: on a GPU; the CPU's has no backward), else SDPA with the dense mask."""
    if isinstance(vocab_extra, Tensor):  # ids [B, R, k]: those of each target's position
        vocab_extra = shared.per_target(vocab_extra.to(shared.targets.device))
    flex = shared.input_ids.is_cuda if flex is None else flex
    inputs = {
        "input_ids": shared.input_ids,
        "position_ids": shared.position_ids,
        "attention_mask": shared.mask(flex),
    }
    with attention_implementation(config, KEEL_FLEX if flex else "sdpa"):
        log_probs, entropy, extras = token_stats(
            inputs, shared.targets, temperature, with_entropy, entropy_grad,
            vocab_extra=vocab_extra, predict_at=shared.predict_at,
        )  # fmt: skip
    entropy = shared.scattered(entropy) if with_entropy else None
    return shared.scattered(log_probs), entropy, tuple(shared.scattered(e) for e in extras)


def flex_attention_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' attention interface (`KEEL_FLEX`): flex attention under the block mask.
    transformers' own flex function passes a score_mod and its own compiled wrapper; this passes
    neither, and is traced into the layer's graph where the layer is compiled (else compiled once
    here: flex attention run eagerly computes the whole [L, L] score matrix). Query heads share
    key heads by flex's own grouping. -> ([rows, L, heads, head_dim], no weights)."""
    from torch.nn.attention.flex_attention import flex_attention

    # what this function does not do, never dropped in silence (the models that share need none)
    unsupported = kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None
    if unsupported or kwargs.get("dropout"):
        raise NotImplementedError("keel's flex attention has no dropout, softcap or sinks")
    if torch.is_autocast_enabled(query.device.type):  # as SDPA is cast: q and k leave RoPE float32
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (x.to(dtype) for x in (query, key, value))
    attend = flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention()
    out = attend(
        query, key, value, block_mask=attention_mask, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
        # rows under 128 tokens would take flex's decoding kernel, whose tiles for grouped heads
        # can be taller than the block mask's 128 (then no kernel fits)
        kernel_options={"FORCE_USE_FLEX_ATTENTION": True},
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


@contextlib.contextmanager
def attention_implementation(config, name: str):
    """The model attends by `name` (transformers' attention functions, or KEEL_FLEX) while
    inside. Its layers read their config's at each call."""
    if name == KEEL_FLEX:
        from transformers import AttentionInterface

        AttentionInterface.register(KEEL_FLEX, flex_attention_forward)
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before
