"""The roofline floor of a GRPO step, phase by phase, from a workload's shapes and a GPU's
datasheet: what no kernel can beat (every matmul at the bf16 dense peak, every byte at HBM's
bandwidth), or, with `--mfu` and `--bandwidth`, what kernels at those shares of them would give.

    python benchmarks/floors.py t1 q1 --gpu H100 --mfu 0.65 --bandwidth 0.8

Assumptions, as keel runs these workloads: decode reads the bf16 weights once a step and each
prompt's keys and values once for its samples (copies read in one row), each row's own response
columns at their mean length; prefill runs once per prompt; the old-log-prob pass skips the first
mini-batch's samples; the head runs on response positions only; fused AdamW reads and writes 28
bytes a float32 parameter each mini-batch."""

from __future__ import annotations

import argparse
import json

from keel.bench.record import DATASHEETS, _head_dim
from keel.bench.workloads import WORKLOADS, shape_config
from keel.models.load import meta_model


def shapes(model: str) -> dict[str, float]:
    """Parameters of the layers' matmuls and of the head, and the KV bytes per token (bf16)."""
    config = shape_config(model)
    net = meta_model(config)
    head = net.get_output_embeddings().weight.numel()
    layers = sum(p.numel() for p in net.get_decoder().layers.parameters() if p.dim() >= 2)
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * _head_dim(config) * 2
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * _head_dim(config)
    total = sum(p.numel() for p in net.parameters())
    return {"layers": layers, "head": head, "kv": kv, "attention": attention, "total": total}


def floors(name: str, gpu: str, mfu: float, bandwidth: float, minis: int) -> dict[str, float]:
    """Seconds per phase of workload `name` at `mfu` of the dense peak and `bandwidth` of HBM's."""
    w, s = WORKLOADS[name], shapes(WORKLOADS[name].model)
    tflops, tbs = DATASHEETS[gpu]
    flop_s, byte_s = tflops * 1e12 * mfu, tbs * 1e12 * bandwidth
    rows, prompts, p, r = w.prompts * w.n, w.prompts, w.prompt_length, w.response_length
    # decode: one step at the mean context, times the steps after prefill's first token
    step_bytes = 2 * (s["layers"] + s["head"]) + s["kv"] * (prompts * p + rows * r / 2)
    step_flops = 2 * (s["layers"] + s["head"]) * rows + s["attention"] * rows * (p + r / 2)
    decode = (r - 1) * max(step_bytes / byte_s, step_flops / flop_s)
    prefill = 2 * s["layers"] * prompts * p / flop_s
    # forward FLOPs over every sample: the layers on every position, the head on the responses
    forward = 2 * (s["layers"] * rows * (p + r) + s["head"] * rows * r)
    forward += s["attention"] * rows * (p + r) * (p + r) / 2
    old = forward * (minis - 1) / minis / flop_s
    update = 3 * forward / flop_s + minis * 28 * s["total"] / byte_s
    phases = {"decode": decode, "prefill": prefill, "old_log_probs": old, "update": update}
    return {**phases, "step": sum(phases.values())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="+")
    parser.add_argument("--gpu", default="H100", choices=sorted(DATASHEETS))
    parser.add_argument("--mfu", type=float, default=1.0)
    parser.add_argument("--bandwidth", type=float, default=1.0)
    parser.add_argument("--minis", type=int, default=4, help="mini-batches an update takes")
    args = parser.parse_args()
    for name in args.workloads:
        row = floors(name, args.gpu, args.mfu, args.bandwidth, args.minis)
        seconds = {phase: round(value, 4) for phase, value in row.items()}
        print(
            json.dumps(
                {
                    "workload": name,
                    "gpu": args.gpu,
                    "mfu": args.mfu,
                    "bandwidth": args.bandwidth,
                    **seconds,
                }
            )
        )


if __name__ == "__main__":
    main()
