"""w4: generation whose lengths vary as EOS makes them, under continuous batching, against fixed
lengths and against chunks without refill, in one run (Qwen2.5-0.5B shapes, random weights, bf16).

64 prompts x 8 samples of 256 tokens; response lengths drawn from a lognormal (median 512, sigma 1,
so a long right tail: p90 about 1850) cut at 2048. A random model never samples EOS, so each
sequence's drawn length is imposed as its turn limit: the scheduler ends a sequence at its limit
exactly as at a stop token (the row is done, read at the next check, and refilled).

    python benchmarks/variable_lengths.py [--rows 256] [--median 512] [--sigma 1.0] [--out FILE]

Prints one JSON line: generated tokens/s with refill (continuous batching), in chunks of `rows`
without refill (each chunk runs until its longest sequence ends: what an engine without refill
does), at fixed length 2048 over `rows` rows (every row busy to the end), and at fixed length over
w2's 256 rows (w2's rollout, the issue's reference), and their ratios.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from keel.bench.run import make_model
from keel.data.prompts import PromptBatch, PromptRecord
from keel.models.load import load_causal_lm, load_tokenizer
from keel.rollout.native import NativeRolloutEngine
from keel.types import SamplingParams


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def drawn_lengths(count: int, median: float, sigma: float, longest: int) -> list[int]:
    generator = torch.Generator().manual_seed(0)
    normal = torch.randn(count, generator=generator)
    return (median * torch.exp(sigma * normal)).round().clamp(1, longest).long().tolist()


def decode_all(
    engine, prompts: list[list[int]], lengths: list[int], group: int, rows: int, longest: int
) -> float:
    """Every sequence generated to its length through one batcher of `rows` rows (one shape for
    every call, so the kept batcher and its graphs serve them all) -> seconds."""
    params = SamplingParams(
        do_sample=True, temperature=1.0, max_new_tokens=longest, ignore_eos=True
    )
    batcher = engine.continuous_batcher(rows, len(prompts[0]) + longest, longest)
    for i, (prompt, length) in enumerate(zip(prompts, lengths)):
        batcher.add(i, prompt, length, group=i // group)
    synchronize()
    start = time.perf_counter()
    done = 0
    while batcher.busy:
        for turn in batcher.step(params):
            assert len(turn.ids) == lengths[turn.key]
            batcher.release(turn.key)
            done += 1
    synchronize()
    assert done == len(prompts)
    return time.perf_counter() - start


def fixed_chunk(engine, prompts: list[list[int]], group: int, longest: int) -> float:
    """The engine's fixed-length path (ignore_eos, one chunk decoded to the end) -> seconds of the
    second of two calls."""
    ids = torch.tensor(prompts)
    records = [
        PromptRecord(
            prompt_ids=row,
            prompt_text="",
            raw_prompt="",
            data_source="bench",
            ground_truth="",
            extra_info={},
            index=i // group,
        )
        for i, row in enumerate(prompts)
    ]
    batch = PromptBatch(ids, torch.ones_like(ids), records)
    params = SamplingParams(
        do_sample=True, temperature=1.0, max_new_tokens=longest, ignore_eos=True
    )
    engine.generate(batch, params)
    synchronize()
    start = time.perf_counter()
    engine.generate(batch, params)
    synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--longest", type=int, default=2048)
    parser.add_argument("--median", type=float, default=512)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--rows", type=int, default=256)
    # w2's batch (32 x 8): its fixed path, in this run
    parser.add_argument("--w2-rows", type=int, default=256)
    # tiny: a CPU check of the script
    parser.add_argument("--model", default="0.5b")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model_dir = make_model(args.model, Path(tempfile.mkdtemp(prefix="keel_w4_")) / "model")
    device, dtype = (
        (torch.device("cuda"), torch.bfloat16)
        if torch.cuda.is_available()
        else (torch.device("cpu"), torch.float32)
    )
    model = load_causal_lm(model_dir, device).to(dtype)
    engine = NativeRolloutEngine(
        model, load_tokenizer(model_dir), args.rows, dtype, free_cache_engine=False
    )
    count = args.prompts * args.n
    prompts = [
        torch.randint(10, 200, (args.prompt,)).tolist()
        for _ in range(args.prompts)
        for _ in range(args.n)
    ]
    # a group's samples share their prompt
    for p in range(args.prompts):
        for s in range(1, args.n):
            prompts[p * args.n + s] = prompts[p * args.n]
    lengths = drawn_lengths(count, args.median, args.sigma, args.longest)
    tokens = sum(lengths)

    def run(prompts_, lengths_):
        return decode_all(engine, prompts_, lengths_, args.n, args.rows, args.longest)

    # compilation and graph capture, for every bucket
    run(prompts, lengths)
    refilled = run(prompts, lengths)
    chunked = sum(
        run(prompts[i : i + args.rows], lengths[i : i + args.rows])
        for i in range(0, count, args.rows)
    )
    fixed_rows = run(prompts[: args.rows], [args.longest] * args.rows)
    # before the fixed-length path's own cache replaces it
    rows_used = engine._kept_batcher.shape[0]
    # the fixed-length path, as w2's
    fixed_s = fixed_chunk(engine, prompts[: args.rows], args.n, args.longest)
    # w2's own rollout: its rows, 2048 each
    w2_s = fixed_chunk(engine, prompts[: args.w2_rows], args.n, args.longest)
    ordered = sorted(lengths)
    record = {
        "workload": "w4",
        "sequences": count,
        "rows": args.rows,
        "prompt_length": args.prompt,
        "lengths": {
            "distribution": (
                f"lognormal(median {args.median:g}, sigma {args.sigma:g}) cut at {args.longest}"
            ),
            "mean": tokens / count,
            "p50": ordered[count // 2],
            "p90": ordered[int(count * 0.9)],
            "p99": ordered[int(count * 0.99)],
            "max": ordered[-1],
        },
        "refilled_tokens_per_s": tokens / refilled,
        "chunked_tokens_per_s": tokens / chunked,
        "fixed_tokens_per_s": args.rows * args.longest / fixed_s,
        "fixed_through_rows_tokens_per_s": args.rows * args.longest / fixed_rows,
        "w2_tokens_per_s": args.w2_rows * args.longest / w2_s,
        "refilled_s": refilled,
        "chunked_s": chunked,
        "fixed_s": fixed_s,
        "fixed_through_rows_s": fixed_rows,
        "rows_used": rows_used,
        "commit": os.environ.get("KEEL_COMMIT", "unknown"),
    }
    record["refilled_over_fixed"] = record["refilled_tokens_per_s"] / record["fixed_tokens_per_s"]
    record["refilled_over_chunked"] = (
        record["refilled_tokens_per_s"] / record["chunked_tokens_per_s"]
    )
    # issue 17's w4 target
    record["refilled_over_w2"] = record["refilled_tokens_per_s"] / record["w2_tokens_per_s"]
    print(json.dumps(record), flush=True)
    if args.out:
        with args.out.open("a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
