"""The engine alternative issue 29 asks to measure: transformers' own decoder modules driven with
keel's KV cache, keel's Triton decode attention and a CUDA graph, against keel's per-family
layers (`profile_decode.py` on the same shapes, batch and context).

    python benchmarks/hf_modules_decode.py --model qwen3-0.6b --batch 128 --column 384 [--check]

transformers' attention interface takes a registered function: here it writes the new token's K
and V into keel's cache at the step's column and runs keel's decode kernel over the cache, so the
model's forward (its projections, norms, rotary and MLP, as the trainer runs them) is one decode
step. Prints one JSON line per variant: ms a step (greedy, logits of the last position included).
`--check` (CPU too): the step's logits against the model's own full forward over the same tokens."""

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoModelForCausalLM

from keel.bench.run import make_model
from keel.rollout.native.attention import (
    sdpa_decode_attention,
    triton_available,
    triton_decode_attention,
)

# this folder's scripts run with it on sys.path
from graph_timing import graph_seconds


class KeelCache:
    """Every layer's K and V [B, KV, length, D], the step's column (on the device) and each row's
    first visible column, as the native engine keeps them."""

    def __init__(self, config, batch: int, length: int, device, dtype):
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        shape = (batch, config.num_key_value_heads, length, head_dim)
        self.layers = [
            (
                torch.zeros(shape, device=device, dtype=dtype),
                torch.zeros(shape, device=device, dtype=dtype),
            )
            for _ in range(config.num_hidden_layers)
        ]
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.pad = torch.zeros(batch, dtype=torch.long, device=device)
        self.triton = triton_available(torch.device(device), dtype, head_dim)

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        """transformers' attention interface: q [B, H, 1, D], the new k, v [B, KV, 1, D] ->
        ([B, 1, H, D], no weights)."""
        k_cache, v_cache = self.layers[module.layer_idx]
        if self.triton:
            out = triton_decode_attention(
                query, key, value, k_cache, v_cache, self.pad, self.column
            )
        else:
            visible = (torch.arange(k_cache.shape[2], device=query.device) <= self.column)[
                None, None, None
            ]
            out = sdpa_decode_attention(
                query, key, value, k_cache, v_cache, self.pad, self.column, visible
            )
        batch, heads, _, dim = query.shape
        return out.view(batch, 1, heads, dim), None


def load(shape: str, device: str, dtype: torch.dtype):
    model_dir = make_model(shape, Path(tempfile.mkdtemp()) / shape)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def decode_step(model, cache: KeelCache, ids, positions):
    """One greedy decode step of transformers' modules over keel's cache."""
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[:, -1]
    return logits, logits.argmax(-1)


def check(model, cache: KeelCache, tokens: int = 12) -> float:
    """Feed `tokens` tokens one step at a time; the last step's logits against the model's full
    forward (sdpa) over them: the largest absolute difference."""
    ids = torch.randint(0, 250, (cache.pad.shape[0], tokens), device=cache.pad.device)
    for column in range(tokens):
        cache.column.fill_(column)
        positions = torch.full_like(ids[:, :1], column)
        with torch.no_grad():
            logits, _ = decode_step(model, cache, ids[:, column : column + 1], positions)
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits[:, -1]
    model.config._attn_implementation = "keel_decode"
    return float((logits.float() - full.float()).abs().max())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument(
        "--column", type=int, default=384, help="the step's cache column (t1's mean context)"
    )
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = load(args.model, device, dtype)
    cache = KeelCache(model.config, args.batch, args.length, device, dtype)
    # Compiled models run the kernel's launcher outside their graph (it reads Python-side tilings).
    AttentionInterface.register("keel_decode", torch.compiler.disable(cache.attention))
    model.config._attn_implementation = "keel_decode"
    if args.check:
        print(
            json.dumps({"model": args.model, "check_max_abs_logit_diff": check(model, cache)}),
            flush=True,
        )
    if device != "cuda":
        return
    cache.column.fill_(args.column)
    ids = torch.randint(0, 250, (args.batch, 1), device=device)
    positions = torch.full_like(ids, args.column)
    variants = {"hf_modules_graph": model, "hf_modules_compiled_graph": torch.compile(model)}
    for name, module in variants.items():
        with torch.no_grad():
            seconds = graph_seconds(
                lambda module=module: decode_step(module, cache, ids, positions)
            )
        row = {"model": args.model, "variant": name, "batch": args.batch, "column": args.column}
        print(json.dumps({**row, "ms_per_step": 1e3 * seconds}), flush=True)


if __name__ == "__main__":
    main()
