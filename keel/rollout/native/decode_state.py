"""The device side of continuous batching: every row's KV cache and turn state (RowState), the
passes that write them through the model runner (prefill, the first token, decode steps), and the
decode step of each batch bucket. On GPU that step is one CUDA graph per power-of-two bucket, kept
while these rows live (as nano-vllm's runner keeps its graphs); slots past the active rows point at
a scratch row that no sequence reads. Which row does what is the scheduler's (scheduler.py).

Rows start at cache column 0 (no left padding): a row's positions are its columns.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from keel.rollout.native.attention import SharedPrefix
from keel.rollout.native.runner import ModelRunner
from keel.rollout.native.scheduler import CopiedPrefixes, Piece, chunk, passes, share_prefill
from keel.rollout.native.state import capture
from keel.types import SamplingParams

try:
    import triton

    from keel.rollout.native.record_kernel import record_kernel
# CPU installs: torch's indexing below
except ImportError:
    record_kernel = None

# Each decode step reads a prompt's keys and values in the one row its samples copied them from
# (CopiedPrefixes): the same bits, one prompt's columns from HBM once (Triton's kernel only).
# benchmarks/levers.py's noshare sets it off before the graphs are captured, to measure the reads.
SHARE_PREFIX_READS = True


@dataclass
class RowState:
    """The device state of every row (the last one is the scratch row); static, as graphs need."""

    # per layer [R + 1, KV, L, D]
    k: list[Tensor]
    v: list[Tensor]
    length: Tensor  # [R + 1] cache columns written
    last_token: Tensor  # [R + 1] the token the next step reads: sampled, not yet in the cache
    count: Tensor  # [R + 1] tokens sampled this turn
    limit: Tensor  # [R + 1] tokens this turn may take
    done: Tensor  # [R + 1] bool: the turn ended
    tokens: Tensor  # [R + 1, T + 1] this turn's tokens
    log_probs: Tensor  # [R + 1, T + 1]
    # [R + 1]: the row whose columns [0, prefix_len) this row's are a copy of (itself: none)
    prefix_row: Tensor
    prefix_len: Tensor
    # the record kernel launched with Hopper's programmatic dependent launch
    programmatic: bool = False

    @classmethod
    def allocate(cls, shape: tuple[int, int, int], runner: ModelRunner) -> RowState:
        """`shape`: rows, tokens a row holds, tokens a turn may take; the cache is `runner`'s."""
        rows, max_len, turn_tokens = shape

        def zeros(*shape, kind=torch.long):
            return torch.zeros(shape, dtype=kind, device=runner.device)

        cache = (rows + 1, runner.kv_heads, max_len, runner.head_dim)
        return cls(
            k=[zeros(*cache, kind=runner.dtype) for _ in range(runner.layers)],
            v=[zeros(*cache, kind=runner.dtype) for _ in range(runner.layers)],
            length=zeros(rows + 1),
            last_token=zeros(rows + 1),
            count=zeros(rows + 1),
            limit=zeros(rows + 1),
            done=torch.ones(rows + 1, dtype=torch.bool, device=runner.device),
            tokens=zeros(rows + 1, turn_tokens + 1),
            log_probs=zeros(rows + 1, turn_tokens + 1, kind=torch.float32),
            prefix_row=torch.arange(rows + 1, device=runner.device),
            prefix_len=zeros(rows + 1),
            programmatic=runner.programmatic,
        )

    def record(
        self,
        rows: Tensor,
        token: Tensor,
        log_prob: Tensor,
        eos: Tensor,
        ignore_eos: bool,
        column: Tensor | None = None,
    ) -> Tensor:
        """This step's token for each of `rows` whose turn goes on, on the device -> which did.
        A row whose turn ended writes past its count, where nothing is read. `column`: each row's
        cache column this step wrote, past which its length moves if its turn went on. On a GPU
        with Triton, one kernel (record_kernel); two slots share a row only where none reads it
        (the batcher's scratch row)."""
        if record_kernel is not None and rows.is_cuda:
            return self._record_in_kernel(rows, token, log_prob, eos, ignore_eos, column)
        live = ~self.done[rows]
        at = self.count[rows].clamp(max=self.tokens.shape[1] - 1)
        self.tokens[rows, at] = token
        self.log_probs[rows, at] = log_prob.float()
        count = self.count[rows] + live
        self.count[rows] = count
        self.last_token[rows] = torch.where(live, token, self.last_token[rows])
        stop = count >= self.limit[rows]
        if not ignore_eos:
            # a comparison, not torch.isin: with many stop tokens isin sorts, which a CUDA graph
            # cannot capture
            stop |= (token[:, None] == eos).any(-1)
        self.done[rows] = self.done[rows] | (live & stop)
        if column is not None:
            self.length[rows] = column + live
        return live

    def _record_in_kernel(self, rows, token, log_prob, eos, ignore_eos, column) -> Tensor:
        live = torch.empty_like(rows, dtype=torch.bool)
        record_kernel[(len(rows),)](
            rows, token, log_prob, rows if column is None else column, eos, self.tokens,
            self.log_probs, self.count, self.limit, self.done, self.last_token, self.length, live,
            self.tokens.stride(0), self.log_probs.stride(0), self.tokens.shape[1] - 1, len(eos),
            IGNORE_EOS=ignore_eos, BLOCK_EOS=triton.next_power_of_2(max(len(eos), 1)),
            LENGTH=column is not None, PDL=self.programmatic, launch_pdl=self.programmatic,
        )  # fmt: skip
        return live


class DecodeState:
    """The rows' device state and what runs on it: `prefill` new tokens, `first_token`, the
    `bucket_step` over the active rows, `done` and `read` to bring results to the host."""

    def __init__(
        self, runner: ModelRunner, eos: Tensor, shape: tuple[int, int, int], prefill_budget: int
    ):
        self.runner, self.eos, self.prefill_budget = runner, eos, prefill_budget
        self.device = runner.device
        self.state = RowState.allocate(shape, runner)
        self.scratch = shape[0]
        # bucket -> (row table, pad, its step)
        self.graphs: dict[int, tuple[Tensor, Tensor, object]] = {}
        self.pool = self._new_pool()
        self.params: SamplingParams | None = None
        # the bucket and rows the tables were last filled with
        self.table: tuple | None = None
        # tokens prefilled over the rows' life
        self.prefilled = 0
        self.prefixes = CopiedPrefixes()

    def _new_pool(self):
        """A private memory pool for CUDA graphs to be captured into."""
        return torch.cuda.graph_pool_handle() if self.runner.use_cuda_graphs else None

    def reset(self) -> None:
        """No turn under way (kept rows, reused by the next call)."""
        self.state.done.fill_(True)
        self.table = None

    def cache_bytes(self) -> int:
        return sum(t.nbytes for t in self.state.k + self.state.v)

    def use(self, params: SamplingParams) -> None:
        """Sampling with `params`: graphs captured with other settings are dropped."""
        # what the captured graphs hold constant
        sampling = dataclasses.replace(params, n=1, max_new_tokens=1)
        if sampling != self.params:
            self.params, self.graphs, self.table = sampling, {}, None
            # New graphs go to a new pool. The dropped graphs' pool lives on while a tensor made in
            # it does, with no graph using it, and capturing into it then fails torch's allocator
            # (`use_count > 0` INTERNAL ASSERT): validation's settings, then training's.
            self.pool = self._new_pool()

    def prefill(self, items: list[tuple[int, int, list[int], object]]) -> Tensor:
        """The prefill of each (row, start, tokens, group): the rows that begin one group's same
        context are prefilled once, the others get a copy of its KV -> logits [len(items), V]."""
        unique, source, copies = share_prefill(items)
        logits = self._prefill(unique)
        # one copy per cache for all of them: columns past a row's context are never read
        if copies:
            to, of = (torch.tensor(rows, device=self.device) for rows in zip(*copies))
            width = max(len(new) for _, _, new, _ in items)
            for cache in self.state.k + self.state.v:
                cache[to, :, :width] = cache[of, :, :width]
        changed = self.prefixes.update(items, copies)
        if changed:
            index = torch.tensor(list(changed), device=self.device)
            row, length = torch.tensor(list(changed.values()), device=self.device).unbind(1)
            self.state.prefix_row[index], self.state.prefix_len[index] = row, length
        return logits[source]

    def first_token(
        self,
        rows: list[int],
        lengths: list[int],
        limits: list[int],
        logits: Tensor,
        params: SamplingParams,
    ) -> list[bool]:
        """Each admitted row (its context `lengths` long) samples its turn's first token -> which
        turns it ended."""
        s, device = self.state, self.device
        rows_t = torch.tensor(rows, device=device)
        s.length[rows_t] = torch.tensor(lengths, device=device)
        s.limit[rows_t] = torch.tensor(limits, device=device)
        s.count[rows_t], s.done[rows_t] = 0, False
        token, log_prob = self.runner.sample(logits, params)
        s.record(rows_t, token, log_prob, self.eos, params.ignore_eos)
        return self.done(rows)

    def done(self, rows: list[int]) -> list[bool]:
        """Whether each row's turn ended (a host sync)."""
        return self.state.done[torch.tensor(rows, device=self.device)].tolist()

    def bucket_step(self, active: list[int], params: SamplingParams):
        """The decode step over the `active` rows: the step of their bucket (the smallest power of
        two holding them), its row table filled with them and the scratch row."""
        bucket = 1 << (len(active) - 1).bit_length()
        if bucket not in self.graphs:
            table = torch.full((bucket,), self.scratch, dtype=torch.long, device=self.device)
            # rows start at column 0
            pad = torch.zeros_like(table)
            step = functools.partial(self._decode, table, pad, params)
            # captured on the scratch row: no sequence is touched
            if self.runner.use_cuda_graphs:
                step = capture(step, self.pool).replay
            # The graph reads table and pad at the addresses it was captured with: they live with
            # it.
            self.graphs[bucket] = (table, pad, step)
        table, _, step = self.graphs[bucket]
        if self.table != (bucket, *active):
            rows = active + [self.scratch] * (bucket - len(active))
            table.copy_(torch.tensor(rows))
            self.table = (bucket, *active)
        return step

    def read(self, rows: list[int]) -> list[tuple[list[int], list[float]]]:
        """The tokens and log-probs each of `rows` sampled this turn."""
        index = torch.tensor(rows, device=self.device)
        s = self.state
        return [
            (ids[:count], log_probs[:count])
            for count, ids, log_probs in zip(
                s.count[index].tolist(), s.tokens[index].tolist(), s.log_probs[index].tolist()
            )
        ]

    def _decode(self, rows: Tensor, pad: Tensor, params: SamplingParams) -> None:
        s = self.state
        column = s.length[rows]
        prefix = SharedPrefix(s.prefix_row, s.prefix_len) if SHARE_PREFIX_READS else None
        logits = self.runner.decode_logits(s.last_token[rows], pad, column, s.k, s.v, rows, prefix)
        token, log_prob = self.runner.sample(logits, params)
        s.record(rows, token, log_prob, self.eos, params.ignore_eos, column)

    def _prefill(self, items: list[Piece]) -> Tensor:
        """The new tokens of each (row, start column, tokens), in passes of at most
        max_num_batched_tokens tokens (a longer extension's leading pieces go first, one pass each:
        chunked prefill) -> logits [len(items), V] at each one's last token."""
        leading, pieces = chunk(items, self.prefill_budget)
        for piece in leading:
            self._extend([piece])
        logits: list[Tensor] = [None] * len(pieces)
        for indices in passes(pieces, self.prefill_budget):
            for i, row_logits in zip(indices, self._extend([pieces[i] for i in indices])):
                logits[i] = row_logits
        return torch.stack(logits)

    def _extend(self, pieces: list[Piece]) -> Tensor:
        """One prefill pass (the runner's) -> logits [u, V] at each row's last new token."""
        self.prefilled += sum(len(new) for _, _, new in pieces)
        return self.runner.prefill(self.state.k, self.state.v, pieces)
