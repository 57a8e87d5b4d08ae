"""Decode attention's tiling, measured as the engine runs it: one call per layer, each layer its own
cache, captured in a CUDA graph and replayed (a kernel timed alone from Python measures its launch).

    python benchmarks/attention_sweep.py [--sweep tiling|splits] [--batch 128 256] [--prompt 256]
        [--response 512] [--shared N] [--best FILE]

For each model shape and batch, every KernelConfig of the sweep (None: as `resolved` chooses) at
mid-response (the mean context of a fixed-length rollout); one JSON line each (us per layer and the
KV bytes it attends per second), then the fastest. `--shared N`: rows in groups of N, each group's
rows holding its first row's prompt columns as copies (a prompt's samples), read there
(attention.SharedPrefix): the bytes attended stay the same, those read from HBM fall."""

import argparse
import json
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from keel.bench.workloads import shape_config
from keel.rollout.native.attention import (
    KernelConfig,
    SharedPrefix,
    sdpa_decode_attention,
    triton_decode_attention,
)

# this folder's scripts run with it on sys.path
from graph_timing import graph_seconds

# tilings at the rollout target's batches; splits for a continuous batch's few long rows
SWEEPS = {
    "tiling": (
        # the engine's default: as `resolved` chooses
        [KernelConfig()]
        + [
            KernelConfig(split=0, block=b, num_warps=w, num_stages=s)
            for b in (16, 32, 64, 128)
            for w in (2, 4, 8)
            for s in (2, 3, 4)
        ]
        + [
            KernelConfig(split=sp, block=b, num_warps=w, num_stages=s)
            for sp in (64, 128, 256)
            for b in (32, 64)
            for w in (2, 4)
            for s in (2, 3)
        ]
    ),
    # a prompt's copies read in one row (--shared) against each row's own: do the tilings move?
    "sharing": [KernelConfig()]
    + [
        KernelConfig(split=sp, block=b, num_warps=w, num_stages=3)
        for sp in (0, 128)
        for b in (32, 64)
        for w in (2, 4)
    ],
    "splits": [KernelConfig(split=0), KernelConfig()]
    + [KernelConfig(split=sp) for sp in (128, 256, 512, 1024)],
}


class Layers:
    """One layer's decode inputs per layer of a model shape, over a cache of `length` columns."""

    def __init__(self, shape: str, batch: int, length: int, prompt: int = 0, shared: int = 1):
        # any family's shapes (head size 64 on Qwen2.5, 128 on Qwen3, 256 on Gemma 3)
        c = shape_config(shape)
        self.heads, self.kv, self.count = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.num_hidden_layers,
        )
        self.dim = getattr(c, "head_dim", None) or c.hidden_size // self.heads
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        self.q = torch.randn(batch, self.heads, 1, self.dim, **bf16)
        self.k, self.v = (torch.randn(batch, self.kv, 1, self.dim, **bf16) for _ in range(2))
        self.caches = [
            (
                torch.randn(batch, self.kv, length, self.dim, **bf16),
                torch.randn(batch, self.kv, length, self.dim, **bf16),
            )
            for _ in range(self.count)
        ]
        self.pad = torch.zeros(batch, dtype=torch.long, device="cuda")
        self.column = torch.zeros(1, dtype=torch.long, device="cuda")
        self.prefix = None
        if shared > 1:
            # each group's rows read its first row's prompt columns; that row reads its own
            rows = torch.arange(batch, device="cuda")
            source = rows // shared * shared
            self.prefix = SharedPrefix(source, torch.where(source == rows, 0, prompt))
            for k_cache, v_cache in self.caches:
                k_cache[:, :, :prompt] = k_cache[source, :, :prompt]
                v_cache[:, :, :prompt] = v_cache[source, :, :prompt]

    def call(self, i: int, config: KernelConfig):
        return triton_decode_attention(
            self.q,
            self.k,
            self.v,
            *self.caches[i],
            self.pad,
            self.column,
            prefix=self.prefix,
            config=config,
        )

    def error(self, config: KernelConfig) -> float:
        length = self.caches[0][0].shape[2]
        visible = (torch.arange(length, device="cuda") <= self.column)[None, None, None]
        expected = sdpa_decode_attention(
            self.q,
            self.k,
            self.v,
            *(c.clone() for c in self.caches[0]),
            self.pad,
            self.column,
            visible,
        )
        return (self.call(0, config).float() - expected.float()).abs().max().item()

    def bytes_at(self, column: int) -> int:
        return 2 * self.count * self.q.shape[0] * self.kv * (column + 1) * self.dim * 2


def sweep(
    shape: str, batch: int, prompt: int, response: int, configs: list[KernelConfig], shared: int = 1
) -> dict:
    layers = Layers(shape, batch, prompt + response, prompt, shared)
    layers.column.fill_(prompt + response // 2)
    results = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for config in configs:
        try:
            seconds = graph_seconds(
                lambda config=config: [layers.call(i, config) for i in range(layers.count)]
            )
        # large tiles of a large head size: not enough shared memory
        except OutOfResources as e:
            print(
                json.dumps(
                    {"shape": shape, "batch": batch, **config.__dict__, "skipped": str(e)[:80]}
                ),
                flush=True,
            )
            continue
        # as the kernel resolves it
        resolved = config.resolved(prompt + response, batch * layers.kv, sms, shared=shared > 1)
        row = {
            "shape": shape,
            "batch": batch,
            "shared": shared,
            "column": prompt + response // 2,
            **config.__dict__,
            "resolved": resolved.__dict__,
            "us_per_layer": 1e6 * seconds / layers.count,
            "tb_per_s": layers.bytes_at(prompt + response // 2) / seconds / 1e12,
        }
        results.append(row)
        print(json.dumps(row), flush=True)
    best = min(results, key=lambda r: r["us_per_layer"])
    best["max_error"] = layers.error(KernelConfig(**{k: best[k] for k in KernelConfig().__dict__}))
    print("best", json.dumps(best), flush=True)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b"])
    p.add_argument("--batch", type=int, nargs="+", default=[128, 256])
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response", type=int, default=512)
    p.add_argument("--sweep", choices=SWEEPS, default="tiling")
    p.add_argument("--shared", type=int, default=1, help="rows a prompt's copies are read for")
    p.add_argument("--best", help="write the fastest KernelConfig per shape and batch here (JSON)")
    args = p.parse_args()
    fields = KernelConfig().__dict__
    best = {
        f"{shape}_{batch}": sweep(
            shape, batch, args.prompt, args.response, SWEEPS[args.sweep], args.shared
        )
        for shape in args.shapes
        for batch in args.batch
    }
    if args.best:
        Path(args.best).write_text(
            json.dumps({key: {k: row[k] for k in fields} for key, row in best.items()})
        )


if __name__ == "__main__":
    main()
