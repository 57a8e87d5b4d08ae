"""keel's rollout engine for Qwen2 and Llama: prefill once per prompt, a static KV cache, decode
steps with fused projections, CUDA graphs on GPU, sampling on the device.

The engine holds one copy of the weights: fused QKV and gate-up projections in the compute dtype,
filled by name from the policy's parameters (`load_weights`: a module's own, or whole parameters
gathered from FSDP shards a bucket at a time). It never keeps the policy module, so a sharded
actor needs no whole float32 copy per rank for generation.

Prefill (compute-bound: plain matmuls and SDPA) runs eagerly over the same weights, once per
distinct prompt, writing its KV into every slot of the prompt's group. Decoding, the memory-bound
part, attends over the static cache (attention.py). On a GPU the step's elementwise work is fused
by torch.compile, and the step is captured as a CUDA graph for each batch it runs at (the chunk,
then smaller as finished sequences leave) and replayed: one launch per token instead of hundreds
from Python.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from keel.models.load import can_compile
from keel.rollout.hf import mask_after_eos, stop_token_ids
from keel.rollout.native.attention import sdpa_decode_attention, triton_available, triton_decode_attention
from keel.rollout.native.sampling import Pickers, pick_blocked, pick_token, sample
from keel.types import RolloutBatch, SamplingParams

log = logging.getLogger("keel")

SUPPORTED_ARCHS = {"qwen2", "llama", "mistral"}
STATIC_ROPE = {"default", "linear", "llama3"}  # inv_freq does not depend on the sequence length
DONE_CHECK_EVERY = 16  # decode steps between checks that every sequence has finished (a host sync)


def unsupported_reason(config) -> str | None:
    """Why the native engine cannot run a model of this (Hugging Face) config, or None when it can."""
    if config.model_type not in SUPPORTED_ARCHS:
        return f"model_type {config.model_type!r} (native supports {sorted(SUPPORTED_ARCHS)})"
    rope = (getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if rope.get("rope_type", rope.get("type", "default")) not in STATIC_ROPE:
        return f"rope type {rope.get('rope_type')!r} (native supports {sorted(STATIC_ROPE)})"
    mistral_window = config.model_type == "mistral" and getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", False) or mistral_window:
        return "sliding-window attention"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    output_bias = config.model_type != "qwen2" and getattr(config, "attention_bias", False)  # Qwen2: q, k, v only
    if getattr(config, "mlp_bias", False) or output_bias:
        return "biases on the MLP or the attention output (the fused decode step has none)"
    return None


@dataclass
class LayerWeights:
    input_norm: Tensor
    qkv: Tensor            # [(H + 2 KV) * D, hidden]
    qkv_bias: Tensor | None
    o: Tensor
    post_norm: Tensor
    gate_up: Tensor        # [2 * intermediate, hidden]
    down: Tensor


class NativeRolloutEngine:
    def __init__(self, model, tokenizer, max_num_seqs: int, dtype: torch.dtype, enforce_eager: bool = False,
                 memory_utilization: float = 0.5, max_num_batched_tokens: int = 8192, compile_step: bool = True,
                 free_cache_engine: bool = True):
        self.tokenizer = tokenizer
        # free_cache_engine=False (verl's key): the KV cache and its CUDA graph stay between calls
        # and are reused when a chunk has the same shape, as fixed-length batches do.
        self.keep_cache = not free_cache_engine
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.memory_utilization = memory_utilization
        self.dtype = dtype
        self.eos_ids = stop_token_ids(tokenizer, model)
        c = model.config
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.eps = c.rms_norm_eps
        self.timing: dict[str, float] = {}  # seconds per part (prefill, capture, decode) of the last call
        self.device = next(model.parameters()).device
        self.eos = torch.tensor(self.eos_ids, device=self.device)
        self._allocate(model)
        self.sync_weights(model)
        # enforce_eager (verl's key): no CUDA graphs, no compilation; for debugging, and CPU's only way.
        self.use_cuda_graphs = not enforce_eager and self.device.type == "cuda"
        self.kernels = _StepFunctions(compiled=self.use_cuda_graphs and compile_step and can_compile(self.device))
        use_triton = triton_available(self.device, dtype, self.head_dim)
        self.attention = triton_decode_attention if use_triton else sdpa_decode_attention

    # --- weights ---------------------------------------------------------------------------------
    def sync_weights(self, model) -> None:
        """The next generate uses the module's current weights (an unsharded policy's own)."""
        self.load_weights(model.named_parameters())

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, Tensor]]) -> None:
        """Fill the decode weights in place, cast to the compute dtype, from (parameter name,
        whole tensor) pairs: every parameter the engine uses, in any order. In place, so CUDA graphs
        kept between calls (free_cache_engine=False) read the new weights."""
        missing = set(self._targets)
        for name, tensor in named:
            if name not in self._targets:
                continue
            buffer, row, shape = self._targets[name]
            if tensor.shape != shape:  # a part-filled buffer would mix old weights with new
                raise RuntimeError(f"native rollout: {name} has shape {tuple(tensor.shape)}, not {tuple(shape)}")
            self._buffers[buffer][row:row + shape[0]].copy_(tensor.detach())
            missing.discard(name)
        if missing:  # a caller bug, not a user's: the engine would generate from stale weights
            raise RuntimeError(f"native rollout: no weights given for {sorted(missing)[:3]}")

    def _allocate(self, model) -> None:
        """The decode weight buffers, where each parameter goes in them (`_targets`), and what is
        read from the model that training never changes (the RoPE frequencies)."""
        sources = _decode_weight_sources(model)
        names = {id(p): name for name, p in model.named_parameters()}
        b = self._buffers = {name: torch.empty(_fused_shape(parts), device=self.device, dtype=self.dtype)
                             for name, parts in sources.items()}
        self._targets: dict[str, tuple[str, int, torch.Size]] = {}  # parameter -> (buffer, first row, shape)
        for buffer, parts in sources.items():
            rows = itertools.accumulate((p.shape[0] for p in parts), initial=0)
            self._targets.update({names[id(p)]: (buffer, row, p.shape) for p, row in zip(parts, rows)})
        self.layers = [LayerWeights(input_norm=b[f"{i}.input_norm"], qkv=b[f"{i}.qkv"], qkv_bias=b.get(f"{i}.qkv_bias"),
                                    o=b[f"{i}.o"], post_norm=b[f"{i}.post_norm"], gate_up=b[f"{i}.gate_up"],
                                    down=b[f"{i}.down"])
                       for i in range(len(model.get_decoder().layers))]
        self.embed, self.final_norm = b["embed"], b["final_norm"]
        self.lm_head = b.get("lm_head", self.embed)  # tied embeddings: one buffer
        rotary = model.get_decoder().rotary_emb
        self.inv_freq = rotary.inv_freq.detach().to(self.device, torch.float32)
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self._kept = None

    # --- generation ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts, params: SamplingParams) -> RolloutBatch:
        size = self._sequences_at_once(prompts.input_ids.shape[1] + params.max_new_tokens)
        self.timing = {}
        parts = [self._generate_chunk(prompts.input_ids[i:i + size], prompts.attention_mask[i:i + size],
                                      [r.index for r in prompts.records[i:i + size]], params)
                 for i in range(0, len(prompts), size)]
        width = max(ids.shape[1] for ids, _ in parts)
        pad = self.tokenizer.pad_token_id
        response_ids = torch.cat([F.pad(ids, (0, width - ids.shape[1]), value=pad) for ids, _ in parts])
        log_probs = torch.cat([F.pad(lp, (0, width - lp.shape[1])) for _, lp in parts])
        response_ids, response_mask, truncated = mask_after_eos(
            response_ids, [] if params.ignore_eos else self.eos_ids, pad, params.max_new_tokens)
        return RolloutBatch(
            prompt_ids=prompts.input_ids, prompt_mask=prompts.attention_mask, response_ids=response_ids,
            response_mask=response_mask, sampling_log_probs=log_probs * response_mask,
            group_index=torch.tensor([r.index for r in prompts.records]), records=list(prompts.records),
            response_texts=self.tokenizer.batch_decode(
                [ids[m.bool()] for ids, m in zip(response_ids, response_mask)], skip_special_tokens=True),
            truncated=truncated)

    def _sequences_at_once(self, seq_len: int) -> int:
        """rollout.max_num_seqs, fewer if their KV cache would pass gpu_memory_utilization of the
        memory available: free on the device, cached by torch's allocator but unused (training
        leaves much there), and the cache this engine keeps (free_cache_engine=False), which a
        chunk of another shape replaces."""
        if self.device.type != "cuda":
            return self.max_num_seqs
        free, _ = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        if self._kept is not None:
            free += sum(t.nbytes for t in self._kept.state.k + self._kept.state.v)
        per_sequence = 2 * len(self.layers) * self.kv_heads * self.head_dim * seq_len * self.embed.element_size()
        fits = max(1, int(free * self.memory_utilization // per_sequence))
        if fits < self.max_num_seqs:
            log.info("native rollout: %d sequences at once (KV cache within %.0f%% of %.1f GB free)", fits,
                     100 * self.memory_utilization, free / 1e9)
        return min(self.max_num_seqs, fits)

    def _generate_chunk(self, input_ids: Tensor, attention_mask: Tensor, groups: list[int],
                        params: SamplingParams) -> tuple[Tensor, Tensor]:
        batch, prompt_len = input_ids.shape
        steps = params.max_new_tokens
        # One prefill per distinct prompt: consecutive rows of the same group share it.
        groups_t = torch.tensor(groups)
        first = torch.ones(batch, dtype=torch.bool)
        first[1:] = groups_t[1:] != groups_t[:-1]
        slot_to_prompt = (first.long().cumsum(0) - 1).to(self.device)                    # [B]
        clock = _Clock(self.device)
        state = self._chunk_state(batch, prompt_len, steps)
        state.pad.copy_((attention_mask == 0).sum(-1).to(self.device))
        prompt_logits = self._prefill(input_ids[first].to(self.device), attention_mask[first].to(self.device),
                                      slot_to_prompt, state)
        token, log_prob = sample(prompt_logits[slot_to_prompt], params, self.kernels.pickers)
        state.record(token, log_prob, self.eos, params.ignore_eos)
        clock.lap("prefill")
        tokens, log_probs = state.tokens.clone(), state.log_probs.clone()  # every row's output
        rows = torch.arange(batch, device=self.device)  # the output row of each state row
        step = self._chunk_step_fn(state, params)
        clock.lap("capture")
        for t in range(1, steps):
            step()
            if t % DONE_CHECK_EVERY or params.ignore_eos:
                continue
            active = (~state.done).nonzero().squeeze(-1)  # a host sync, every DONE_CHECK_EVERY steps
            if len(active) <= len(rows) // 2:  # half finished (or all): they leave the batch
                tokens[rows], log_probs[rows] = state.tokens, state.log_probs
                if len(active) == 0:
                    break
                state, rows = state.keep(active), rows[active]
                step = self._decode_step_fn(state, params)
        tokens[rows], log_probs[rows] = state.tokens, state.log_probs
        clock.lap("decode")
        for part, seconds in clock.laps.items():
            self.timing[part] = self.timing.get(part, 0.0) + seconds
        used = int(state.step.item())
        return tokens[:, :used].cpu(), log_probs[:, :used].float().cpu()

    def _chunk_state(self, batch: int, prompt_len: int, steps: int) -> "_DecodeState":
        """A new decode state for a chunk or, keeping the cache, the kept one when the shape matches
        (no need to clear its KV: every column a step reads was written in this call)."""
        shape = (batch, prompt_len, steps)
        if self._kept is not None and self._kept.shape == shape:
            self._kept.state.reset(self.tokenizer.pad_token_id)
            return self._kept.state
        self._kept = None  # a kept cache of another shape goes before the new one is allocated
        state = _DecodeState.allocate(self, batch, prompt_len, steps)
        if self.keep_cache:
            self._kept = _KeptCache(shape, state)
        return state

    def _chunk_step_fn(self, state: "_DecodeState", params: SamplingParams):
        """The decode step of a chunk: the kept graph when the state and sampling are the same."""
        kept = self._kept
        if kept is None or kept.state is not state:
            return self._decode_step_fn(state, params)
        if kept.params != params:  # sampling settings are constants in the captured graph
            kept.params, kept.step = params, self._decode_step_fn(state, params)
        return kept.step

    def _prefill(self, input_ids: Tensor, attention_mask: Tensor, slot_to_prompt: Tensor,
                 state: "_DecodeState") -> Tensor:
        """A forward over the distinct prompts, at most max_num_batched_tokens prompt tokens per
        pass; each prompt's KV goes to every slot of its group. -> [U, V] logits."""
        per_pass = max(1, self.max_num_batched_tokens // input_ids.shape[1])
        logits = []
        for start in range(0, input_ids.shape[0], per_pass):
            ids, mask = input_ids[start:start + per_pass], attention_mask[start:start + per_pass]
            slots = ((slot_to_prompt >= start) & (slot_to_prompt < start + len(ids))).nonzero().squeeze(-1)
            hidden = self._prompt_forward(ids, mask, state, slots, slot_to_prompt[slots] - start)
            logits.append(F.linear(hidden, self.lm_head))  # already normed
        return torch.cat(logits)

    def _prompt_forward(self, ids: Tensor, mask: Tensor, state: "_DecodeState", slots: Tensor,
                        prompt_of_slot: Tensor) -> Tensor:
        """The last position's normed hidden state [u, H] of left-padded prompts [u, P], their K
        and V written to the cache rows `slots` (prompt_of_slot: each slot's row of `ids`). A pass
        takes at most max_num_batched_tokens tokens: a longer prompt goes in pieces, each
        attending to the cache the earlier ones wrote (chunked prefill)."""
        u, prompt_len = ids.shape
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        first_slots = slots[torch.searchsorted(prompt_of_slot, torch.arange(u, device=ids.device))]
        piece = max(1, self.max_num_batched_tokens // u)
        unpadded = bool(mask.all())  # one host sync per pass
        for begin in range(0, prompt_len, piece):
            end = min(begin + piece, prompt_len)
            x = F.embedding(ids[:, begin:end], self.embed).flatten(0, 1)                       # [N, H]
            cos, sin = _rope(positions[:, begin:end].flatten(), self.inv_freq, self.rope_scale, self.dtype)
            # No mask where plain causal attention is right: SDPA may then use its flash kernel,
            # and no [u, L, end] mask is built.
            visible = None if unpadded and begin == 0 else _prompt_visibility(mask[:, :end].bool(), begin)
            h = _rms_norm(x, self.layers[0].input_norm, self.eps)
            for i, w in enumerate(self.layers):
                q, k, v = _attention_inputs(h, w.qkv, w.qkv_bias, cos, sin, self.heads, self.kv_heads)
                q, k, v = (t.view(u, end - begin, t.shape[1], t.shape[-1]).transpose(1, 2) for t in (q, k, v))
                state.k[i][slots, :, begin:end] = k[prompt_of_slot]
                state.v[i][slots, :, begin:end] = v[prompt_of_slot]
                if begin > 0:  # earlier pieces' K/V too, as the cache holds them
                    k, v = state.k[i][first_slots, :, :end], state.v[i][first_slots, :, :end]
                attention = _grouped_attention(q, k, v, visible)                                 # [u, H, L, D]
                next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
                attention = attention.transpose(1, 2).reshape(x.shape[0], -1)                   # [N, H * D]
                x, h = _attention_output_and_mlp(x, attention, w.o, w.post_norm, w.gate_up, w.down, next_norm,
                                                 self.eps)
        return h.view(u, end - begin, -1)[:, -1]

    def _decode_step_fn(self, state: "_DecodeState", params: SamplingParams):
        """One decode step as a callable: a CUDA graph replay on GPU, the eager step elsewhere."""
        def eager() -> None:
            token, log_prob = sample(self._decode_logits(state), params, self.kernels.pickers)
            state.record(token, log_prob, self.eos, params.ignore_eos)

        if not self.use_cuda_graphs:
            return eager
        # A graph replays on the addresses it was captured with: captured per chunk, unless the
        # cache is kept (free_cache_engine=False) and reused with the same state.
        return _DecodeGraph(eager, state).replay

    def _decode_logits(self, s: "_DecodeState") -> Tensor:
        """Logits [B, V] for the last sampled token of every row, its K and V written to the cache.

        Around the attention (one Triton kernel on GPU, which also writes the cache), each layer is
        two pure functions that torch.compile fuses on GPU (norms, RoPE, residual adds and the SiLU
        gate become a handful of kernels around the matmuls): decoding a small model is bound by
        kernel launches and bytes read, not FLOPs."""
        f = self.kernels
        column = s.prompt_len + s.step - 1                                        # [1] cache column
        x, cos, sin, visible = f.step_inputs(s.last_token, s.pad, column, s.k[0].shape[2], self.embed,
                                             self.inv_freq, self.rope_scale)
        h = f.rms_norm(x, self.layers[0].input_norm, self.eps)
        for i, w in enumerate(self.layers):
            q, k, v = f.attention_inputs(h, w.qkv, w.qkv_bias, cos, sin, self.heads, self.kv_heads)
            attention = self.attention(q, k, v, s.k[i], s.v[i], s.pad, column, visible)  # writes k, v
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            x, h = f.attention_output_and_mlp(x, attention, w.o, w.post_norm, w.gate_up, w.down, next_norm,
                                              self.eps)
        return F.linear(h, self.lm_head)


def _decode_weight_sources(model) -> dict[str, list[Tensor]]:
    """Each decode weight as the module tensors it is made of, stacked by rows (fused QKV and
    gate-up projections)."""
    decoder = model.get_decoder()
    sources = {"embed": [decoder.embed_tokens.weight], "final_norm": [decoder.norm.weight]}
    if model.get_output_embeddings().weight is not decoder.embed_tokens.weight:
        sources["lm_head"] = [model.get_output_embeddings().weight]
    for i, layer in enumerate(decoder.layers):
        attn, mlp = layer.self_attn, layer.mlp
        sources.update({f"{i}.input_norm": [layer.input_layernorm.weight],
                        f"{i}.qkv": [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
                        f"{i}.o": [attn.o_proj.weight], f"{i}.post_norm": [layer.post_attention_layernorm.weight],
                        f"{i}.gate_up": [mlp.gate_proj.weight, mlp.up_proj.weight], f"{i}.down": [mlp.down_proj.weight]})
        if attn.q_proj.bias is not None:
            sources[f"{i}.qkv_bias"] = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
    return sources


def _fused_shape(parts: list[Tensor]) -> torch.Size:
    return torch.Size([sum(p.shape[0] for p in parts), *parts[0].shape[1:]])


def _grouped_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None) -> Tensor:
    """SDPA of q [u, H, L, D] over k, v [u, KV, S, D]: causal when `visible` is None, else under
    that mask. K/V are repeated to every query head, as transformers' SDPA path does: not every
    fused SDPA kernel that takes a mask also takes grouped heads (enable_gqa)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, is_causal=visible is None)


def _prompt_visibility(key_mask: Tensor, begin: int) -> Tensor:
    """[u, 1, L, end] bool: the query at absolute position begin + l sees key column j when j is
    at or before it and not padding. A padding query sees itself, so no row is empty (SDPA would
    give NaN; its output is never used: decoding starts after the padding)."""
    end = key_mask.shape[1]
    query = torch.arange(begin, end, device=key_mask.device)[:, None]                   # [L, 1]
    key = torch.arange(end, device=key_mask.device)[None, :]                            # [1, end]
    return (((key <= query) & key_mask[:, None, :]) | (key == query))[:, None]


class _StepFunctions:
    """The pure parts of a decode step, compiled by torch.compile where it can fuse them (CUDA
    with Triton), plain functions elsewhere (CPU, or `rollout.enforce_eager`)."""

    def __init__(self, compiled: bool):
        functions = dict(step_inputs=_step_inputs, rms_norm=_rms_norm, attention_inputs=_attention_inputs,
                         attention_output_and_mlp=_attention_output_and_mlp, pick_token=pick_token,
                         pick_blocked=pick_blocked)
        for name, fn in functions.items():
            setattr(self, name, torch.compile(fn, fullgraph=True) if compiled else fn)
        self.pickers = Pickers(self.pick_token, self.pick_blocked)


def _step_inputs(last_token: Tensor, pad: Tensor, column: Tensor, cache_len: int, embed: Tensor, inv_freq: Tensor,
                 rope_scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Embeddings [B, hidden], RoPE cos/sin [B, 1, D] at each row's position (left padding
    skipped), and the visible cache columns [B, 1, 1, L]."""
    positions = column - pad                                                    # [B]
    cols = torch.arange(cache_len, device=pad.device)
    visible = ((cols >= pad[:, None]) & (cols <= column))[:, None, None]        # [B, 1, 1, L]
    cos, sin = _rope(positions, inv_freq, rope_scale, embed.dtype)
    return F.embedding(last_token, embed), cos, sin, visible


def _attention_inputs(h: Tensor, qkv_weight: Tensor, qkv_bias: Tensor | None, cos: Tensor, sin: Tensor, heads: int,
                      kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, H, 1, D] and k [B, KV, 1, D] rotated, v [B, KV, 1, D], from the normed hidden state."""
    batch, head_dim = h.shape[0], cos.shape[-1]
    qkv = F.linear(h, qkv_weight, qkv_bias)
    kv_size = kv_heads * head_dim
    qk = _apply_rope(qkv[:, :-kv_size].view(batch, heads + kv_heads, head_dim), cos, sin)
    v = qkv[:, -kv_size:].view(batch, kv_heads, 1, head_dim)
    return qk[:, :heads].unsqueeze(2), qk[:, heads:].unsqueeze(2), v


def _attention_output_and_mlp(x: Tensor, attention: Tensor, o: Tensor, post_norm: Tensor, gate_up: Tensor,
                              down: Tensor, next_norm: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The rest of a decoder layer: output projection and residual, the gated MLP and residual;
    also the next layer's normed input, so the residual stream is read once."""
    x = _residual_add(x, F.linear(attention, o))
    gate, up = F.linear(_rms_norm(x, post_norm, eps), gate_up).chunk(2, dim=-1)
    x = _residual_add(x, F.linear(F.silu(gate) * up, down))
    return x, _rms_norm(x, next_norm, eps)


def _residual_add(x: Tensor, y: Tensor) -> Tensor:
    """x + y, rounded as a 16-bit add rounds (both are exact in float32). Written in float32 so
    that inductor fuses the add into the norm that reads it, rather than into the matmul as
    `addmm`, whose beta-add first copies x into the output: one more kernel per residual."""
    return (x.float() + y.float()).to(x.dtype)


class _Clock:
    """Seconds per part of a generate call (synchronised on GPU), kept as engine.timing."""

    def __init__(self, device: torch.device):
        self.device = device
        self.laps: dict[str, float] = {}
        self.last = self._now()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, name: str) -> None:
        now = self._now()
        self.laps[name] = self.laps.get(name, 0.0) + now - self.last
        self.last = now


@dataclass
class _DecodeState:
    """Static buffers of one generation chunk (CUDA graphs replay on fixed addresses)."""
    k: list[Tensor]            # per layer [B, KV, P + R, D]
    v: list[Tensor]
    tokens: Tensor             # [B, R] sampled tokens
    log_probs: Tensor          # [B, R]
    last_token: Tensor         # [B]
    done: Tensor               # [B] bool
    pad: Tensor                # [B] left-padding columns of each prompt
    step: Tensor               # [1] tokens sampled so far
    prompt_len: int

    @classmethod
    def allocate(cls, engine: NativeRolloutEngine, batch: int, prompt_len: int, steps: int) -> "_DecodeState":
        dev = engine.device
        shape = (batch, engine.kv_heads, prompt_len + steps, engine.head_dim)
        return cls(k=[torch.zeros(shape, device=dev, dtype=engine.dtype) for _ in engine.layers],
                   v=[torch.zeros(shape, device=dev, dtype=engine.dtype) for _ in engine.layers],
                   tokens=torch.full((batch, steps), engine.tokenizer.pad_token_id, dtype=torch.long, device=dev),
                   log_probs=torch.zeros((batch, steps), device=dev), last_token=torch.zeros(batch, dtype=torch.long,
                                                                                          device=dev),
                   done=torch.zeros(batch, dtype=torch.bool, device=dev), pad=torch.zeros(batch, dtype=torch.long,
                                                                                         device=dev),
                   step=torch.zeros(1, dtype=torch.long, device=dev), prompt_len=prompt_len)

    def reset(self, pad_token_id: int) -> None:
        """Ready for a new chunk of the same shape (the caller sets `pad`)."""
        self.tokens.fill_(pad_token_id)
        self.log_probs.zero_()
        self.last_token.zero_()
        self.done.zero_()
        self.step.zero_()

    def keep(self, rows: Tensor) -> "_DecodeState":
        """A smaller state holding only `rows` (finished sequences leave the batch)."""
        return _DecodeState(k=[k[rows] for k in self.k], v=[v[rows] for v in self.v], tokens=self.tokens[rows],
                            log_probs=self.log_probs[rows], last_token=self.last_token[rows], done=self.done[rows],
                            pad=self.pad[rows], step=self.step.clone(), prompt_len=self.prompt_len)

    def record(self, token: Tensor, log_prob: Tensor, eos: Tensor, ignore_eos: bool) -> None:
        """Write this step's token and advance, on the device (what follows an EOS is masked later)."""
        index = self.step.expand(token.shape[0]).unsqueeze(-1)
        self.tokens.scatter_(1, index, token.unsqueeze(-1))
        self.log_probs.scatter_(1, index, log_prob.unsqueeze(-1))
        if not ignore_eos:
            self.done |= torch.isin(token, eos)
        self.last_token.copy_(token)
        self.step += 1


@dataclass
class _KeptCache:
    """free_cache_engine=False: the last chunk's state (KV cache) and its captured step."""
    shape: tuple[int, int, int]  # batch, prompt length, steps
    state: _DecodeState
    params: SamplingParams | None = None
    step: object = None


class _DecodeGraph:
    """A decode step captured once and replayed; warm-up runs on a side stream first, as CUDA
    graph capture requires."""

    def __init__(self, step_fn, state: _DecodeState):
        self.state = state  # the graph reads and writes its buffers: they live as long as it does
        # The warm-up runs the step, so its outputs are put back afterwards. The KV cache is not:
        # the step writes only the current column, from the current token, and the first replay
        # writes the same values there again.
        saved = (state.step.clone(), state.tokens.clone(), state.log_probs.clone(), state.last_token.clone(),
                 state.done.clone())
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step_fn()  # warm-up: allocator and kernel selection
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # recorded, not run
            step_fn()
        step, tokens, log_probs, last, done = saved
        state.step.copy_(step), state.tokens.copy_(tokens), state.log_probs.copy_(log_probs)
        state.last_token.copy_(last), state.done.copy_(done)

    def replay(self) -> None:
        self.graph.replay()


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """As Qwen2/Llama compute it: in float32, scaled by the weight in the input dtype."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rope(positions: Tensor, inv_freq: Tensor, scale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos [B, 1, D] and sin [B, 1, D] with the rotate-half sign folded in (-sin on the first half)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]                       # [B, D/2]
    cos = torch.cat([freqs, freqs], dim=-1).cos() * scale
    sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1) * scale
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, heads, D] rotated by its row's position: x cos + rotate_half(x) sin, where
    rotate_half(x) = [-x2, x1] and the minus sign lives in `sin`."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin
