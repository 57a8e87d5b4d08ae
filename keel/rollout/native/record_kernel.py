"""The decode step's bookkeeping as one Triton kernel (decode_state.RowState.record launches it and
says what it does): each slot's sampled token and log-prob written at its row's count, the count,
last token, stop and cache length moved on. In torch it is about twenty gathers, scatters and
elementwise kernels per step, each a few microseconds of a step that takes 1.5 ms at Qwen2.5-0.5B's
shapes. Imported only where Triton is installed."""

import triton
import triton.language as tl

from keel.rollout.native.attention_kernels import programmatic_start


@triton.jit
def record_kernel(
    Rows, Token, LogProb, Column, Eos, Tokens, LogProbs, Count, Limit, Done, LastToken, Length,
    Live, tokens_b, log_probs_b, last_at, eos_count,
    IGNORE_EOS: tl.constexpr, BLOCK_EOS: tl.constexpr, LENGTH: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    programmatic_start(PDL)
    # one program per slot; its row of the state is Rows[slot]
    slot = tl.program_id(0)
    row = tl.load(Rows + slot)
    token = tl.load(Token + slot)
    live = tl.load(Done + row) == 0
    count = tl.load(Count + row)
    # a row whose turn ended writes past its count, where nothing is read
    at = tl.minimum(count, last_at)
    tl.store(Tokens + row * tokens_b + at, token)
    tl.store(LogProbs + row * log_probs_b + at, tl.load(LogProb + slot).to(tl.float32))
    count += live.to(count.dtype)
    tl.store(Count + row, count)
    tl.store(LastToken + row, tl.where(live, token, tl.load(LastToken + row)))
    stop = count >= tl.load(Limit + row)
    if not IGNORE_EOS:
        e = tl.arange(0, BLOCK_EOS)
        eos = tl.load(Eos + e, mask=e < eos_count, other=-1)
        stop = stop | (tl.sum((eos == token).to(tl.int32), axis=0) > 0)
    tl.store(Done + row, tl.load(Done + row) | (live & stop))
    tl.store(Live + slot, live)
    if LENGTH:
        tl.store(Length + row, tl.load(Column + slot) + live.to(count.dtype))
