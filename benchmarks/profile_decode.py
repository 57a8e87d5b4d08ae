"""Where the native engine's generation time goes on a GPU (Qwen2.5 shapes, random weights):
prefill, graph capture and decode per step for each variant (compiled graphs, the engine's default;
max-autotune compilation; graphs without compilation; eager), then the top kernels of 64 compiled
steps.

    python benchmarks/profile_decode.py [--model 0.5b] [--batch 128] [--prompt 256] [--steps 256]
    [--n 8]
        [--variants compiled_graphs autotuned graphs eager] [--attention BEST.json] [--no-profile]
"""

import argparse
import functools
import json
import tempfile
import time
from pathlib import Path

import torch

from keel.bench.run import make_model
from keel.data.prompts import PromptBatch, PromptRecord
from keel.models.load import load_causal_lm, load_tokenizer
from keel.rollout.native import NativeRolloutEngine
from keel.rollout.native.attention import KernelConfig, triton_decode_attention
from keel.types import SamplingParams


def prompts(batch: int, n: int, length: int) -> PromptBatch:
    ids = torch.randint(10, 200, (batch // n, length)).repeat_interleave(n, 0)
    records = [
        PromptRecord(
            prompt_ids=row.tolist(),
            prompt_text="",
            raw_prompt="",
            data_source="bench",
            ground_truth="",
            extra_info={},
            index=i // n,
        )
        for i, row in enumerate(ids)
    ]
    return PromptBatch(ids, torch.ones_like(ids), records)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--model", default="0.5b")
    p.add_argument("--variants", nargs="+", default=["compiled_graphs", "graphs", "eager"])
    p.add_argument("--no-profile", action="store_true", help="the timings only")
    p.add_argument(
        "--attention",
        help="a JSON file of attention_sweep.py's fastest KernelConfig per shape and batch",
    )
    args = p.parse_args()
    model_dir = make_model(args.model, Path(tempfile.gettempdir()) / f"keel_profile_{args.model}")
    model = load_causal_lm(model_dir, torch.device("cuda"))
    tokenizer = load_tokenizer(model_dir)
    batch = prompts(args.batch, args.n, args.prompt)
    params = SamplingParams(n=args.n, max_new_tokens=args.steps, ignore_eos=True)
    report = {}
    variants = {
        "compiled_graphs": {},
        "autotuned": {"compile_mode": "max-autotune-no-cudagraphs"},
        "graphs": {"compile_step": False},
        "eager": {"enforce_eager": True},
    }
    variants = {name: variants[name] for name in args.variants}
    for name, options in variants.items():
        engine = NativeRolloutEngine(model, tokenizer, 4096, torch.bfloat16, **options)
        if args.attention and engine.attention is triton_decode_attention:
            config = KernelConfig(
                **json.loads(Path(args.attention).read_text())[f"{args.model}_{args.batch}"]
            )
            engine.attention = functools.partial(triton_decode_attention, config=config)
            report["attention_config"] = config.__dict__
        start = time.perf_counter()
        # warm-up (and compilation)
        engine.generate(batch, params)
        torch.cuda.synchronize()
        warm_up = time.perf_counter() - start
        start = time.perf_counter()
        engine.generate(batch, params)
        torch.cuda.synchronize()
        total = time.perf_counter() - start
        report[name] = {
            "total_s": total,
            **engine.timing,
            "ms_per_step": 1e3 * engine.timing["decode"] / (args.steps - 1),
            "tokens_per_s": args.batch * args.steps / total,
            "warm_up_s": warm_up,
        }
        print(name, json.dumps(report[name]), flush=True)
    if args.no_profile:
        return
    engine = NativeRolloutEngine(model, tokenizer, 4096, torch.bfloat16)
    # compiled, warm
    engine.generate(batch, SamplingParams(n=args.n, max_new_tokens=64, ignore_eos=True))
    activities = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        engine.generate(batch, SamplingParams(n=args.n, max_new_tokens=64, ignore_eos=True))
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90)
    )
    # Which Python line launches the costliest operators (kernels inside a graph replay have none):
    print(
        prof.key_averages(group_by_stack_n=6).table(
            sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60
        )
    )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
