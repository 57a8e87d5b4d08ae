"""Where the native engine's generation time goes on a GPU (Qwen2.5-0.5B shapes, random weights):
prefill, graph capture, decode per step (graph replay and eager), and an eager step's top kernels.

    python benchmarks/profile_decode.py [--batch 128] [--prompt 256] [--steps 256] [--n 8]
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from profile_update import timed  # this folder's scripts run with it on sys.path

from keel.bench.run import make_model
from keel.data.prompts import PromptBatch, PromptRecord
from keel.models.load import load_causal_lm, load_tokenizer
from keel.rollout.native import NativeRolloutEngine
from keel.types import SamplingParams


def prompts(batch: int, n: int, length: int) -> PromptBatch:
    ids = torch.randint(10, 200, (batch // n, length)).repeat_interleave(n, 0)
    records = [PromptRecord(prompt_ids=row.tolist(), prompt_text="", raw_prompt="", data_source="bench",
                            ground_truth="", extra_info={}, index=i // n) for i, row in enumerate(ids)]
    return PromptBatch(ids, torch.ones_like(ids), records)


def attention_alone(batch: int, config, cache_len: int) -> dict:
    """One layer's decode attention over a full cache, by implementation: is it the bottleneck?"""
    from keel.rollout.native.attention import sdpa_decode_attention, triton_decode_attention

    kv, heads, dim = config.num_key_value_heads, config.num_attention_heads, config.hidden_size // config.num_attention_heads
    q = torch.randn(batch, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, kv, cache_len, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    new_k, new_v = k[:, :, :1].clone(), v[:, :, :1].clone()
    pad = torch.zeros(batch, dtype=torch.long, device="cuda")
    column = torch.tensor([cache_len // 2], device="cuda")  # half the cache written: mid-decode
    visible = (torch.arange(cache_len, device="cuda") <= column)[None, None, None].expand(batch, 1, 1, -1)

    def matmuls():
        g = q.view(batch, kv, heads // kv, dim)
        scores = (g @ k.transpose(-1, -2)) * dim ** -0.5
        return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v).reshape(batch, -1)

    variants = {"sdpa_grouped": lambda: sdpa_decode_attention(q, new_k, new_v, k, v, pad, column, visible),
                "triton": lambda: triton_decode_attention(q, new_k, new_v, k, v, pad, column), "matmuls": matmuls}
    reference = variants["sdpa_grouped"]().float()
    out = {"triton_max_error": (variants["triton"]().float() - reference).abs().max().item()}
    for name, fn in variants.items():
        out[name] = 1e3 * timed(fn, reps=50)
    for block in (32, 64, 128):  # the kernel's tile: which is fastest here?
        for warps in (2, 4, 8):
            out[f"triton_b{block}_w{warps}"] = 1e3 * timed(
                lambda: triton_decode_attention(q, new_k, new_v, k, v, pad, column, block=block, num_warps=warps),
                reps=50)
    out["bytes_gb"] = 2 * k.numel() * k.element_size() / 1e9
    print("attention", json.dumps(out), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--model", default="0.5b")
    args = p.parse_args()
    model_dir = make_model(args.model, Path(tempfile.gettempdir()) / f"keel_profile_{args.model}")
    model = load_causal_lm(model_dir, torch.device("cuda"))
    tokenizer = load_tokenizer(model_dir)
    batch = prompts(args.batch, args.n, args.prompt)
    params = SamplingParams(n=args.n, max_new_tokens=args.steps, ignore_eos=True)
    report = {}
    variants = {"compiled_graphs": {}, "graphs": {"compile_step": False}, "eager": {"enforce_eager": True}}
    for name, options in variants.items():
        engine = NativeRolloutEngine(model, tokenizer, 4096, torch.bfloat16, **options)
        engine.generate(batch, params)  # warm-up (and compilation)
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(batch, params)
        torch.cuda.synchronize()
        total = time.perf_counter() - start
        report[name] = {"total_s": total, **engine.timing, "ms_per_step": 1e3 * engine.timing["decode"] / (args.steps - 1),
                        "tokens_per_s": args.batch * args.steps / total}
        print(name, json.dumps(report[name]), flush=True)
    report["attention_ms_per_layer"] = attention_alone(args.batch, model.config, args.prompt + args.steps)
    engine = NativeRolloutEngine(model, tokenizer, 4096, torch.bfloat16)
    engine.generate(batch, SamplingParams(n=args.n, max_new_tokens=64, ignore_eos=True))  # compiled, warm
    activities = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        engine.generate(batch, SamplingParams(n=args.n, max_new_tokens=64, ignore_eos=True))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))
    # Which Python line launches the costliest operators (kernels inside a graph replay have none):
    print(prof.key_averages(group_by_stack_n=6).table(sort_by="self_cuda_time_total", row_limit=12,
                                                      max_name_column_width=60))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
