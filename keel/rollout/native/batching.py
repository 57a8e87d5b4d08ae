"""Continuous batching in the native engine: a sequence keeps a row of one KV cache for as long as
it lasts (every turn of a multi-turn episode), and each decode step runs over the rows generating
now, whatever each one's position.

- A sequence that stops (a stop token, its turn's limit) leaves the decode batch and keeps its KV.
  When it comes back with new tokens (a tool's output and the template's next prompt, a user turn),
  only those are prefilled, after its cached columns.
- Sequences waiting for a row take the rows of finished ones: the long tail of single-turn
  rollouts with EOS decodes beside new prompts instead of alone.
- The decode step reads a table of the rows it runs over. On GPU it is one CUDA graph per
  power-of-two batch bucket, kept while the batcher lives; slots past the active rows point at a
  scratch row that no sequence reads.

Rows start at cache column 0 (no left padding): a row's positions are its columns.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from keel.rollout.native.runner import ModelRunner
from keel.rollout.native.state import Clock, capture
from keel.types import SamplingParams

# decode steps between looks at which turns ended (a host sync)
DONE_CHECK_EVERY = 16
# prefill keys gathered in one pass, in units of max_num_batched_tokens
KEYS_PER_PASS = 8


@dataclass
class Finished:
    """A turn that ended: its sampled tokens (the stop token included) and their log-probs."""

    key: object
    ids: list[int]
    log_probs: list[float]


@dataclass
class Waiting:
    key: object
    # the sequence's whole context: what is cached, then the new tokens
    context: list[int]
    # tokens this turn may take
    limit: int
    # sequences of one group with the same first context share its prefill
    group: object = None


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

    @classmethod
    def allocate(
        cls,
        rows: int,
        max_len: int,
        turn_tokens: int,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> RowState:
        def zeros(*shape, kind=torch.long):
            return torch.zeros(shape, dtype=kind, device=device)

        cache = (rows + 1, kv_heads, max_len, head_dim)
        return cls(
            k=[zeros(*cache, kind=dtype) for _ in range(layers)],
            v=[zeros(*cache, kind=dtype) for _ in range(layers)],
            length=zeros(rows + 1),
            last_token=zeros(rows + 1),
            count=zeros(rows + 1),
            limit=zeros(rows + 1),
            done=torch.ones(rows + 1, dtype=torch.bool, device=device),
            tokens=zeros(rows + 1, turn_tokens + 1),
            log_probs=zeros(rows + 1, turn_tokens + 1, kind=torch.float32),
        )

    def record(
        self, rows: Tensor, token: Tensor, log_prob: Tensor, eos: Tensor, ignore_eos: bool
    ) -> Tensor:
        """This step's token for each of `rows` whose turn goes on, on the device -> which did.
        A row whose turn ended writes past its count, where nothing is read."""
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
        return live


class ContinuousBatcher:
    """Sequences added with `add` generate one turn each time they are added; `step` admits,
    decodes a few steps and returns the turns that ended; `release` gives a sequence's row back."""

    def __init__(
        self,
        runner: ModelRunner,
        eos: Tensor,
        shape: tuple[int, int, int],
        prefill_budget: int,
        timing: dict[str, float],
    ):
        """`shape`: rows, tokens a row holds, tokens a turn may take; `prefill_budget`: tokens one
        prefill pass takes (max_num_batched_tokens); `timing`: where seconds per part add up."""
        rows, max_len, turn_tokens = self.shape = shape
        self.runner, self.eos, self.prefill_budget, self.timing = (
            runner,
            eos,
            prefill_budget,
            timing,
        )
        self.device = runner.device
        self.state = RowState.allocate(
            rows,
            max_len,
            turn_tokens,
            layers=runner.layers,
            kv_heads=runner.kv_heads,
            head_dim=runner.head_dim,
            dtype=runner.dtype,
            device=runner.device,
        )
        self.scratch = rows
        # bucket -> (row table, pad, its step)
        self.graphs: dict[int, tuple[Tensor, Tensor, object]] = {}
        self.pool = torch.cuda.graph_pool_handle() if runner.use_cuda_graphs else None
        self.params: SamplingParams | None = None
        # tokens prefilled over the batcher's life
        self.prefilled = 0
        self.reset()

    def reset(self) -> None:
        """Every row free (a kept batcher, reused by the next call)."""
        self.free = list(range(self.scratch))[::-1]
        self.row_of: dict[object, int] = {}
        self.key_of: dict[int, object] = {}
        # per row: the context so far (cached, then last_token)
        self.contexts: dict[int, list[int]] = {}
        self.waiting: list[Waiting] = []
        self.active: list[int] = []
        # per active row: most tokens its turn may still take
        self.left: dict[int, int] = {}
        self.state.done.fill_(True)
        self.table: tuple | None = None

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    @property
    def runnable(self) -> bool:
        """Whether `step` has work now: rows decoding, or a waiting turn with a row to take."""
        return bool(self.active) or any(w.key in self.row_of or self.free for w in self.waiting)

    def add(self, key, context: list[int], limit: int, group=None) -> None:
        """A turn for `key`: a new sequence, or one returning with its context extended."""
        rows, max_len, turn_tokens = self.shape
        if not 0 < limit <= turn_tokens or len(context) + limit > max_len:
            raise ValueError(
                f"a turn of {limit} tokens after {len(context)} does not fit rows of {max_len} tokens, "
                f"turns of {turn_tokens}"
            )
        if any(w.key == key for w in self.waiting) or self.row_of.get(key) in self.active:
            raise ValueError(f"{key!r} already has a turn under way")
        self.waiting.append(Waiting(key, list(context), limit, group))

    def cut(self) -> list[Finished]:
        """Every turn under way ended where it is (a partial rollout's round ends): what each row
        decoding has sampled so far; turns still waiting for a row are dropped with none."""
        cut = self._read(self.active)
        self.active, self.waiting = [], []
        return cut

    def release(self, key) -> None:
        row = self.row_of.pop(key)
        del self.key_of[row], self.contexts[row]
        self.free.append(row)

    @torch.no_grad()
    def step(self, params: SamplingParams, look_every: int | None = None) -> list[Finished]:
        """Admit what has a row, decode up to DONE_CHECK_EVERY (or `look_every`) steps -> the turns that ended."""
        # what the captured graphs hold constant
        sampling = dataclasses.replace(params, n=1, max_new_tokens=1)
        if sampling != self.params:
            self.params, self.graphs, self.table = sampling, {}, None
        clock = Clock(self.device)
        finished = self._admit(params)
        clock.lap("prefill")
        if self.active:
            left = [self.left[row] for row in self.active]
            # Without stop tokens no turn ends before its limit: decode to the first that ends, no
            # look between.
            steps = min(
                min(left) if params.ignore_eos else DONE_CHECK_EVERY,
                max(left),
                look_every or max(left),
            )
            run = self._bucket_step(params)
            clock.lap("capture")
            for _ in range(steps):
                run()
            for row in self.active:
                self.left[row] -= steps
            finished += self._collect()
            clock.lap("decode")
        for part, seconds in clock.laps.items():
            self.timing[part] = self.timing.get(part, 0.0) + seconds
        return finished

    # --- admission: prefill of the new tokens, the turn's first token
    # ------------------------------
    def _admit(self, params: SamplingParams) -> list[Finished]:
        admitted, self.waiting = self._take_rows(self.waiting)
        if not admitted:
            return []
        rows = [row for row, _ in admitted]
        logits = self._prefill_shared(
            [(row, *self._extension(row, item), item.group) for row, item in admitted]
        )
        self._first_token(rows, logits, [item.limit for _, item in admitted], params)
        done = self.state.done[torch.tensor(rows, device=self.device)].tolist()
        for row, ended, (_, item) in zip(rows, done, admitted):
            if not ended:
                self.active.append(row)
                self.left[row] = item.limit - 1
        return self._read([row for row, ended in zip(rows, done) if ended])

    def _extension(self, row: int, item: Waiting) -> tuple[int, list[int]]:
        """(first column to prefill, the tokens from there): all of a new sequence's context, or
        what follows a returning one's cached columns (its last sampled token first)."""
        cached = max(len(self.contexts[row]) - 1, 0)
        if item.context[:cached] != self.contexts[row][:cached]:
            raise RuntimeError("a returning sequence's context must extend what it generated")
        if len(item.context) <= cached:
            raise ValueError(f"{item.key!r} came back with no new tokens")
        self.contexts[row] = item.context
        return cached, item.context[cached:]

    def _prefill_shared(self, items: list[tuple[int, int, list[int], object]]) -> Tensor:
        """The prefill of each (row, start, tokens, group): the rows that begin one group's same
        context are prefilled once, the others get a copy of its KV -> logits [len(items), V]."""
        # (group, context) -> its index in `unique`
        first_of: dict[tuple, int] = {}
        # what is prefilled; each item's index in it
        unique, source = [], []
        for row, start, new, group in items:
            shared = (group, tuple(new)) if start == 0 and group is not None else None
            if shared is None or shared not in first_of:
                if shared is not None:
                    first_of[shared] = len(unique)
                unique.append((row, start, new))
            source.append(first_of[shared] if shared is not None else len(unique) - 1)
        logits = self._prefill(unique)
        copies = [(row, unique[i][0]) for (row, *_), i in zip(items, source) if unique[i][0] != row]
        # one copy per cache for all of them: columns past a row's context are never read
        if copies:
            to, of = (torch.tensor(rows, device=self.device) for rows in zip(*copies))
            width = max(len(new) for _, _, new, _ in items)
            for cache in self.state.k + self.state.v:
                cache[to, :, :width] = cache[of, :, :width]
        return logits[source]

    def _take_rows(self, waiting: list[Waiting]) -> tuple[list[tuple[int, Waiting]], list[Waiting]]:
        """(row, item) for each item with a row (its own, or a free one); the rest wait."""
        admitted, still = [], []
        for item in waiting:
            row = self.row_of.get(item.key)
            if row is None and self.free:
                row = self.free.pop()
                self.row_of[item.key], self.key_of[row], self.contexts[row] = row, item.key, []
            if row is None:
                still.append(item)
            else:
                admitted.append((row, item))
        return admitted, still

    def _first_token(
        self, rows: list[int], logits: Tensor, limits: list[int], params: SamplingParams
    ) -> None:
        s, device = self.state, self.device
        rows_t = torch.tensor(rows, device=device)
        s.length[rows_t] = torch.tensor([len(self.contexts[row]) for row in rows], device=device)
        s.limit[rows_t] = torch.tensor(limits, device=device)
        s.count[rows_t], s.done[rows_t] = 0, False
        token, log_prob = self.runner.sample(logits, params)
        s.record(rows_t, token, log_prob, self.eos, params.ignore_eos)

    def _prefill(self, items: list[tuple[int, int, list[int]]]) -> Tensor:
        """The new tokens of each (row, start column, tokens), in passes of at most
        max_num_batched_tokens tokens (a longer extension's leading pieces go first, one pass each:
        chunked prefill) -> logits [len(items), V] at each one's last token."""
        budget = self.prefill_budget
        pieces = []
        for row, start, new in items:
            while len(new) > budget:
                self._extend([(row, start, new[:budget])])
                start, new = start + budget, new[budget:]
            pieces.append((row, start, new))
        logits: list[Tensor] = [None] * len(pieces)
        for indices in _passes(pieces, budget):
            for i, row_logits in zip(indices, self._extend([pieces[i] for i in indices])):
                logits[i] = row_logits
        return torch.stack(logits)

    def _extend(self, pieces: list[tuple[int, int, list[int]]]) -> Tensor:
        """One prefill pass (the runner's) -> logits [u, V] at each row's last new token."""
        self.prefilled += sum(len(new) for _, _, new in pieces)
        return self.runner.prefill(self.state.k, self.state.v, pieces)

    # --- decoding
    # ----------------------------------------------------------------------------------
    def _bucket_step(self, params: SamplingParams):
        """The decode step over the active rows: the step of their bucket (the smallest power of
        two holding them), its row table filled with them and the scratch row."""
        bucket = 1 << (len(self.active) - 1).bit_length()
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
        if self.table != (bucket, *self.active):
            rows = self.active + [self.scratch] * (bucket - len(self.active))
            table.copy_(torch.tensor(rows))
            self.table = (bucket, *self.active)
        return step

    def _decode(self, rows: Tensor, pad: Tensor, params: SamplingParams) -> None:
        s = self.state
        column = s.length[rows]
        logits = self.runner.decode_logits(s.last_token[rows], pad, column, s.k, s.v, rows=rows)
        token, log_prob = self.runner.sample(logits, params)
        s.length[rows] = column + s.record(rows, token, log_prob, self.eos, params.ignore_eos)

    def _collect(self) -> list[Finished]:
        done = self.state.done[torch.tensor(self.active, device=self.device)].tolist()
        ended = [row for row, d in zip(self.active, done) if d]
        self.active = [row for row, d in zip(self.active, done) if not d]
        return self._read(ended)

    def _read(self, rows: list[int]) -> list[Finished]:
        """The ended turns of `rows`, their tokens added to the rows' contexts."""
        if not rows:
            return []
        index = torch.tensor(rows, device=self.device)
        s = self.state
        finished = []
        for row, count, ids, log_probs in zip(
            rows, s.count[index].tolist(), s.tokens[index].tolist(), s.log_probs[index].tolist()
        ):
            self.contexts[row] = self.contexts[row] + ids[:count]
            self.left.pop(row, None)
            finished.append(Finished(self.key_of[row], ids[:count], log_probs[:count]))
        return finished


def _passes(pieces: list[tuple[int, int, list[int]]], budget: int) -> list[list[int]]:
    """Indices of `pieces` per prefill pass, each pass within `budget` new tokens (and its keys within
    KEYS_PER_PASS budgets); pieces of similar widths share a pass."""
    order = sorted(range(len(pieces)), key=lambda i: -len(pieces[i][2]))
    passes, current = [], []
    for i in order:
        if current and not _fits([pieces[j] for j in current + [i]], budget):
            passes.append(current)
            current = []
        current.append(i)
    passes.append(current)
    return passes


def _fits(pieces, budget: int) -> bool:
    widest = max(len(new) for _, _, new in pieces)
    furthest = max(start + len(new) for _, start, new in pieces)
    return len(pieces) * widest <= budget and len(pieces) * furthest <= KEYS_PER_PASS * budget
