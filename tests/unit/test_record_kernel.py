"""The decode step's bookkeeping kernel (record_kernel) against RowState.record's torch indexing,
under Triton's interpreter on the CPU (where Triton is installed; not in keel's CPU install): every
field a row's turn reads afterwards is the same, with stop tokens and without, with the cache
length moved and without, and two slots on the scratch row."""

import pytest

from tests_helpers import compile_for_hopper, run_under_triton_interpreter

INTERPRETED_RECORD = """
import torch
from keel.rollout.native.decode_state import RowState

def state(seed):
    g = torch.Generator().manual_seed(seed)
    rows, turn = 6, 5
    s = RowState(
        k=[], v=[],
        length=torch.randint(0, 50, (rows + 1,), generator=g),
        last_token=torch.randint(0, 9, (rows + 1,), generator=g),
        count=torch.randint(0, 7, (rows + 1,), generator=g),
        limit=torch.randint(1, 7, (rows + 1,), generator=g),
        done=torch.rand(rows + 1, generator=g) < 0.3,
        tokens=torch.zeros(rows + 1, turn + 1, dtype=torch.long),
        log_probs=torch.zeros(rows + 1, turn + 1),
        prefix_row=torch.arange(rows + 1),
        prefix_len=torch.zeros(rows + 1, dtype=torch.long),
    )
    s.done[rows] = True  # the scratch row
    return s

def read(s):
    return [s.length, s.last_token, s.count, s.done, s.tokens, s.log_probs]

stopped = 0
for ignore_eos in (True, False):
    for with_column in (True, False):
        for seed in range(5):
            # slots 4 and 5 on the scratch row (6), which nothing reads
            rows = torch.tensor([3, 0, 5, 2, 6, 6])
            token, log_prob = torch.tensor([4, 7, 1, 7, 2, 3]), torch.randn(6)
            column = torch.tensor([10, 11, 12, 13, 14, 14]) if with_column else None
            eos = torch.tensor([7, 1])
            torch_state, kernel_state = state(seed), state(seed)
            live = torch_state.record(rows, token, log_prob, eos, ignore_eos, column)
            kernel_live = kernel_state._record_in_kernel(
                rows, token, log_prob, eos, ignore_eos, column
            )
            assert torch.equal(live[:4], kernel_live[:4])
            for a, b in zip(read(torch_state), read(kernel_state)):
                assert torch.equal(a[:6], b[:6]), (ignore_eos, with_column, seed, a, b)
            stopped += int(kernel_state.done[:6].sum() - state(seed).done[:6].sum())
# turns ended here, by their limits or stop tokens
assert stopped > 0
print("ok")
"""


def test_the_record_kernel_matches_torch_under_the_interpreter():
    pytest.importorskip("triton")
    run_under_triton_interpreter(INTERPRETED_RECORD)


@pytest.mark.parametrize("ignore_eos", [True, False])
@pytest.mark.parametrize("length", [True, False])
def test_the_record_kernel_compiles_for_hopper_without_a_gpu(ignore_eos, length):
    """Its compiler builds the kernel for sm_90 (H100, H200) on any machine, where Triton is
    installed: a compile error shows here before a GPU's time is spent."""
    pytest.importorskip("triton")
    from keel.rollout.native.record_kernel import record_kernel

    pointers = {name: "*i64" for name in record_kernel.arg_names if name[0].isupper()}
    pointers |= dict.fromkeys(["LogProb", "LogProbs"], "*fp32") | dict.fromkeys(
        ["Done", "Live"], "*i1"
    )
    constants = dict(IGNORE_EOS=ignore_eos, BLOCK_EOS=2, LENGTH=length, PDL=False)
    pointers = {name: kind for name, kind in pointers.items() if name not in constants}
    assert "record_kernel" in compile_for_hopper(record_kernel, pointers, constants)
