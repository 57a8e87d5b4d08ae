"""Decode attention's kernel at one model shape, launched plainly (no CUDA graph) for Nsight Compute
to read its hardware counters: where its time goes (HBM and L2 throughput, occupancy and what
limits it, the warps' stall reasons), which attention_sweep.py's timings alone cannot say.

    ncu --set full -k regex:decode_attention_kernel --launch-skip 28 --launch-count 1 \\
        python3 benchmarks/attention_ncu.py --shape qwen3-0.6b --shared 8

Each round calls every layer once (the first round compiles the kernel), at mid-response as
attention_sweep.py does; `--split`, `--block`, `--warps`, `--stages` set the tiling (default: as
`KernelConfig.resolved` chooses)."""

import argparse

import torch

# this folder's scripts run with it on sys.path
from attention_sweep import Layers

from keel.rollout.native.attention import KernelConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response", type=int, default=256)
    p.add_argument("--shared", type=int, default=8, help="rows a prompt's copies are read for")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--split", type=int)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int)
    args = p.parse_args()
    config = KernelConfig(
        split=args.split, block=args.block, num_warps=args.warps, num_stages=args.stages
    )
    layers = Layers(args.shape, args.batch, args.prompt + args.response, args.prompt, args.shared)
    layers.column.fill_(args.prompt + args.response // 2)
    for _ in range(args.rounds):
        for i in range(layers.count):
            layers.call(i, config)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
