"""Small batches for unit tests, a spy on the engine service, and Triton kernels run or compiled
without a GPU."""

import dataclasses
import os
import subprocess
import sys

import torch

from keel.types import TrainBatch


def make_batch(response_lengths: list[int], width: int = 6) -> TrainBatch:
    n = len(response_lengths)
    mask = torch.tensor([[1] * k + [0] * (width - k) for k in response_lengths])
    return TrainBatch(
        prompt_ids=torch.ones(n, 3, dtype=torch.long),
        prompt_mask=torch.ones(n, 3, dtype=torch.long),
        response_ids=torch.arange(n * width).view(n, width),
        response_mask=mask,
        sampling_log_probs=torch.zeros(n, width),
        group_index=torch.arange(n),
        records=list(range(n)),
        response_texts=[str(i) for i in range(n)],
        truncated=torch.zeros(n, dtype=torch.bool),
        scores=torch.zeros(n),
        token_level_rewards=torch.zeros(n, width),
        advantages=torch.zeros(n, width),
        returns=torch.zeros(n, width),
    )


def padded_batch(
    vocab: int, prompt_lengths: list[int], response_lengths: list[int], seed: int = 0, low: int = 0
) -> TrainBatch:
    """Left-padded prompts and right-padded responses of the given lengths, random tokens in
    [low, vocab)."""
    generator = torch.Generator().manual_seed(seed)
    n, prompt_width, width = len(prompt_lengths), max(prompt_lengths), max(response_lengths)
    prompt_mask = torch.tensor([[0] * (prompt_width - p) + [1] * p for p in prompt_lengths])
    batch = make_batch(response_lengths, width)
    return dataclasses.replace(
        batch,
        prompt_ids=torch.randint(low, vocab, (n, prompt_width), generator=generator) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.randint(low, vocab, (n, width), generator=generator)
        * batch.response_mask,
    )


class Spy:
    """The engine service, recording every completion it hands out."""

    def __init__(self, service):
        self.service, self.sampled, self.extended = service, {}, {}

    def __getattr__(self, name):
        return getattr(self.service, name)

    def submit(self, key, context, limit):
        future = self.service.submit(key, context, limit)

        def keep(done):
            if done.exception() is None:
                self.sampled.setdefault(key, []).append(done.result().ids)
                self.extended.setdefault(key, []).append(done.result().extended)

        future.add_done_callback(keep)
        return future


def run_under_triton_interpreter(script: str) -> None:
    """`script` in a Python of its own under Triton's interpreter (TRITON_INTERPRET=1, which Triton
    reads at import), on the CPU: it must exit cleanly, having printed "ok"."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def compile_for_hopper(kernel, pointers: dict, constants: dict, floats=()) -> str:
    """`kernel` compiled by Triton for sm_90 (H100, H200), on any machine -> its PTX. `pointers`:
    each pointer argument's type ("*bf16"); `constants`: the constexprs' values; `floats`: the fp32
    scalars; every other argument an i64."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {
        name: "constexpr"
        if name in constants
        else pointers.get(name, "fp32" if name in floats else "i64")
        for name in names
    }
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(name),): value for name, value in constants.items()},
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
