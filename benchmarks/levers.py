"""`keel bench` with an experimental lever switched on in this process, to learn whether it is worth
building into keel before it is (issue 50). Each lever patches keel as the bench imports it:

  cudnn     half-precision attention may take cuDNN's kernel, as torch 2.11 chooses (keel keeps
            it off: pytorch#196678), so what avoiding it costs the update shows
  graphs    the trainer's compiled decoder layers replay as CUDA graphs (torch.compile's
            reduce-overhead mode: cudagraph trees), taking the host's launches out of the update
  nogc      Python's cyclic garbage collector off for the run (torchtitan collects on a schedule of
            its own), so a collection's pause between two kernels shows
  noshare   every decode row reads its prompt's keys and values in its own cache, as before keel
            read a prompt's samples' copies in one row (decode_state.SHARE_PREFIX_READS): the
            baseline that sharing is measured against
  norecord  the decode step's bookkeeping by torch's indexing, about twenty kernels, as before one
            Triton kernel did it (decode_state.record_kernel)
  pdl       the decode step's Triton kernels (inductor's and keel's) launched with Hopper's
            programmatic dependent launch, each starting as the one before it ends
            (runner.PROGRAMMATIC_LAUNCH)
  shareprompt  a micro-batch's samples of one prompt computed with the prompt once, through flex
            attention's block mask (training/shared_prompt.SHARE_PROMPTS), in the old-log-prob
            pass, the reference's, the update and distillation's teacher pass
  norotary  each layer's query and key heads normed and rotated by torch.compile's kernels before
            the decode attention, as before the kernel did it itself (runner.ROTARY_IN_ATTENTION)

  python benchmarks/levers.py LEVER[,LEVER...] t1 --gpus 1 --steps 3 --warmup 1 --out OUT.jsonl

The record gains `"levers": [NAME, ...]` so the rows tell themselves apart.
"""

from __future__ import annotations

import functools
import gc
import sys

import torch


def cudnn() -> None:
    import keel.models.load as load

    load.avoid_cudnn_attention = lambda: None


def graphs() -> None:
    import keel.distributed.parallelize as parallelize

    compile_blocks = parallelize.compile_blocks

    def in_graphs(model):
        # keel's own compile_blocks, its torch.compile calls in reduce-overhead mode
        compile = torch.compile
        torch.compile = functools.partial(compile, mode="reduce-overhead")
        try:
            compile_blocks(model)
        finally:
            torch.compile = compile

    parallelize.compile_blocks = in_graphs


def nogc() -> None:
    gc.disable()


def noshare() -> None:
    import keel.rollout.native.decode_state as decode_state

    decode_state.SHARE_PREFIX_READS = False


def norecord() -> None:
    import keel.rollout.native.decode_state as decode_state

    decode_state.record_kernel = None


def pdl() -> None:
    import keel.rollout.native.runner as runner

    runner.PROGRAMMATIC_LAUNCH = True


def shareprompt() -> None:
    import keel.training.shared_prompt as shared_prompt

    shared_prompt.SHARE_PROMPTS = True


def norotary() -> None:
    import keel.rollout.native.runner as runner

    runner.ROTARY_IN_ATTENTION = False


LEVERS = {
    "cudnn": cudnn,
    "graphs": graphs,
    "nogc": nogc,
    "noshare": noshare,
    "norecord": norecord,
    "norotary": norotary,
    "pdl": pdl,
    "shareprompt": shareprompt,
}


def main(argv: list[str]) -> int:
    names, bench_args = argv[0].split(","), argv[1:]
    for name in names:
        LEVERS[name]()
    import keel.bench.run as run
    from keel.cli import main as keel_main

    append_record = run.append_record

    def tagged(out, record):
        append_record(out, {**record, "levers": names})

    run.append_record = tagged
    return keel_main(["bench", *bench_args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
