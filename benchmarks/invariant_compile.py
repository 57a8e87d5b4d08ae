"""Whether a batch-invariant rollout gives log_prob_gap 0 as this tree builds it (its decode step
compiled), and under which compiler settings: the sampler's log-probs against the
old-log-prob pass (scoring.py) on the GPU, as tests/gpu/test_batch_invariant_cuda.py checks them,
for each variant in a process of its own (inductor's settings and caches are per process).

    python benchmarks/invariant_compile.py [--variants as_is eager no_fma]

- as_is: keel's engine as this tree builds it (decode compiled with emulate_precision_casts,
  prefill taking the same compiled functions);
- eager: enforce_eager (no compilation, no CUDA graphs): the reference, 0 by construction;
- no_fma: TRITON_DEFAULT_FP_FUSION=0 (no multiply-add contraction in Triton's kernels).

One JSON line per variant and model: the summed absolute gap over response tokens, and tokens/s of
the invariant generation (compile time included on the first call, so the second call's)."""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = ("as_is", "eager", "no_fma")


def check(variant: str, arch: str, hidden: int, layers: int) -> dict:
    import torch

    from keel.data.prompts import build_prompt_dataset, collate_prompts
    from keel.models.load import load_causal_lm, load_tokenizer
    from keel.models.tiny import make_tiny_model
    from keel.rollout.native import NativeRolloutEngine
    from keel.rollout.native.scoring import score
    from keel.types import SamplingParams

    # head size 32 at hidden 128 (the GPU test's), 64 at 896 (Qwen2.5-0.5B's 14 heads over 2)
    heads = 4 if hidden == 128 else hidden // 64
    # weights of std 0.1, as the GPU test draws them: logits spread enough for rounding to show
    model_dir = make_tiny_model(
        tempfile.mkdtemp(), arch=arch, hidden_size=hidden, num_layers=layers, seed=1,
        num_heads=heads, num_kv_heads=2, initializer_range=0.1,
    )  # fmt: skip
    device = torch.device("cuda")
    tokenizer, model = load_tokenizer(model_dir), load_causal_lm(model_dir, device)
    prompts = [{"prompt": "Digits please: 1"}, {"prompt": "a longer prompt here, padded out"}]
    records, _ = build_prompt_dataset(prompts, tokenizer, max_prompt_length=64)
    batch_prompts = collate_prompts(records, tokenizer.pad_token_id).repeat_interleave(16)
    params = SamplingParams(n=16, temperature=1.0, max_new_tokens=64, ignore_eos=True)
    engine = NativeRolloutEngine(
        model,
        tokenizer,
        256,
        torch.bfloat16,
        batch_invariant=True,
        enforce_eager=variant == "eager",
        max_num_batched_tokens=512,
    )
    gaps, seconds = [], 0.0
    for call in range(2):
        torch.manual_seed(call)
        start = time.perf_counter()
        batch = engine.generate(batch_prompts, params)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        gap = (score(engine, batch, 1.0) - batch.sampling_log_probs).abs() * batch.response_mask
        gaps.append(float(gap.sum()))
    tokens = int(batch.response_mask.sum())
    return {"variant": variant, "arch": arch, "hidden": hidden, "gaps": gaps,
            "decode_tokens_per_s": tokens / seconds}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--one", nargs=4, metavar=("VARIANT", "ARCH", "HIDDEN", "LAYERS"))
    args = p.parse_args()
    if args.one:
        variant, arch, hidden, layers = args.one
        print(json.dumps(check(variant, arch, int(hidden), int(layers))), flush=True)
        return
    for variant in args.variants:
        env = dict(os.environ)
        if variant == "no_fma":
            env["TRITON_DEFAULT_FP_FUSION"] = "0"
        for arch, hidden, layers in (("qwen3", 128, 2), ("qwen2", 896, 4)):
            done = subprocess.run(
                [sys.executable, __file__, "--one", variant, arch, str(hidden), str(layers)],
                capture_output=True,
                text=True,
                env=env,
                timeout=300,
            )
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            print(lines[-1] if lines else json.dumps(
                {"variant": variant, "arch": arch, "hidden": hidden, "error": done.stderr[-800:]}
            ), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
