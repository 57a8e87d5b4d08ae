"""Where the update's time goes on a GPU (Qwen2.5-0.5B shapes, random weights, float32 master
weights under bf16 autocast, as keel trains): a no-grad log-prob forward and a forward+backward of
one micro-batch, timed, then the top kernels of the backward step, how much of the compiled
training step the host needs just to issue its work (`train_issue_share`: 1.0 means the GPU waits on
Python), and the Python functions that take that time (cProfile, by own time).

    python benchmarks/profile_update.py [--samples 32] [--prompt 256] [--response 256]
"""

import argparse
import cProfile
import json
import pstats
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from keel.bench.workloads import QWEN25_COMMON, QWEN25_SHAPES
from keel.distributed.parallelize import compile_blocks
from keel.training.forward import response_log_probs
from keel.training.placement import Placement
from keel.types import TrainBatch


def make_batch(samples: int, prompt: int, response: int) -> TrainBatch:
    ids = lambda n: torch.randint(10, 200, (samples, n))  # noqa: E731
    ones = lambda n: torch.ones(samples, n, dtype=torch.long)  # noqa: E731
    return TrainBatch(
        prompt_ids=ids(prompt),
        prompt_mask=ones(prompt),
        response_ids=ids(response),
        response_mask=ones(response),
        sampling_log_probs=torch.zeros(samples, response),
        group_index=torch.arange(samples),
        records=[None] * samples,
        response_texts=[""] * samples,
        truncated=torch.zeros(samples, dtype=torch.bool),
        scores=torch.zeros(samples),
        token_level_rewards=torch.zeros(samples, response),
        advantages=torch.zeros(samples, response),
        returns=torch.zeros(samples, response),
    )


def timed(fn, reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def issue_share(fn) -> float:
    """Seconds the host takes to issue fn's work (until fn returns) over the seconds until the GPU
    has done it: near 1, the GPU waits on Python."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    return issued / (time.perf_counter() - start)


def python_profile(fn) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    torch.cuda.synchronize()
    profiler.disable()
    print("--- python, compiled training step (own time)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response", type=int, default=256)
    args = p.parse_args()
    config = Qwen2Config(**QWEN25_COMMON, **QWEN25_SHAPES["0.5b"])
    model = AutoModelForCausalLM.from_config(config).cuda()
    batch = make_batch(args.samples, args.prompt, args.response)
    tokens = args.samples * (args.prompt + args.response)

    # actor.use_torch_compile's vocabulary part is plan.fused_vocab
    plan = Placement()

    def forward():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            response_log_probs(model, batch, 1.0, plan=plan)

    # the decoder alone, no lm_head: is the time in the layers or the vocabulary?
    def decoder_only():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            model.get_decoder()(input_ids=batch.input_ids.cuda(), use_cache=False)

    def train_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            log_probs, entropy = response_log_probs(model, batch, 1.0, with_entropy=True, plan=plan)
        (log_probs.mean() + 0 * entropy.mean()).backward()

    params = sum(p.numel() for p in model.parameters())
    report = {
        "tokens": tokens,
        "attn_implementation": model.config._attn_implementation,
        "forward_s": timed(forward),
        "decoder_only_s": timed(decoder_only),
        "train_s": timed(train_step),
    }
    # actor.use_torch_compile, in its two parts: the vocabulary arithmetic, then the layers too.
    plan = Placement(fused_vocab=True)
    report["forward_vocab_compiled_s"], report["train_vocab_compiled_s"] = (
        timed(forward),
        timed(train_step),
    )
    compile_blocks(model)
    report["forward_all_compiled_s"], report["train_all_compiled_s"] = (
        timed(forward),
        timed(train_step),
    )
    plan = Placement(fused_vocab=False)
    report["forward_layers_compiled_s"], report["train_layers_compiled_s"] = (
        timed(forward),
        timed(train_step),
    )
    # keel's default on GPU: both parts compiled
    plan = Placement(fused_vocab=True)
    report["train_issue_share"] = issue_share(train_step)
    python_profile(train_step)
    report["train_tflops"] = 6 * params * tokens / report["train_s"] / 1e12
    report["forward_tflops"] = 2 * params * tokens / report["forward_s"] / 1e12
    for name, fn in (("forward", forward), ("train", train_step)):
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
        ) as prof:
            fn()
            torch.cuda.synchronize()
        print(f"--- {name}")
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=25, max_name_column_width=70
            )
        )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
