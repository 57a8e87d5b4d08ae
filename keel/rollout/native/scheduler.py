"""The native engine's scheduler: which sequence holds which row of the KV cache, which turns wait
for a row, which rows decode now, how many tokens each turn may still take, and how new tokens are
packed into prefill passes. Plain Python, no tensors (nano-vllm's Scheduler): the batcher
(batching.py) asks it what to run and tells it what the device did.

- A sequence keeps its row for as long as it lasts (every turn of a multi-turn episode); a turn that
  comes back with new tokens prefills only those, after its cached columns.
- Sequences waiting for a row take the rows of released ones.
"""

from __future__ import annotations

from dataclasses import dataclass

# prefill keys gathered in one pass, in units of max_num_batched_tokens
KEYS_PER_PASS = 8

# (cache row, first column, the tokens written from there)
Piece = tuple[int, int, list[int]]


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
class Admission:
    """A turn that took its row: what to prefill there, from which column."""

    row: int
    start: int
    new: list[int]
    group: object
    # tokens the turn may take
    limit: int


class Scheduler:
    """Rows for `shape` = (rows, tokens a row holds, tokens a turn may take). `add` a turn; `admit`
    gives the turns that have a row; `started` and `decoded` are told what the device did;
    `finish` records a turn's tokens; `release` gives a sequence's row back."""

    def __init__(self, shape: tuple[int, int, int]):
        self.shape = shape
        self.reset()

    def reset(self) -> None:
        """Every row free (a kept batcher, reused by the next call)."""
        self.free = list(range(self.shape[0]))[::-1]
        self.row_of: dict[object, int] = {}
        self.key_of: dict[int, object] = {}
        # per row: the context so far (cached, then last_token)
        self.contexts: dict[int, list[int]] = {}
        self.waiting: list[Waiting] = []
        self.active: list[int] = []
        # per active row: most tokens its turn may still take
        self.left: dict[int, int] = {}

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    @property
    def runnable(self) -> bool:
        """Whether a step has work now: rows decoding, or a waiting turn with a row to take."""
        return bool(self.active) or any(w.key in self.row_of or self.free for w in self.waiting)

    def holds(self, key) -> bool:
        """Whether `key` holds a row (its KV cache kept between turns)."""
        return key in self.row_of

    def add(self, key, context: list[int], limit: int, group=None) -> None:
        """A turn for `key`: a new sequence, or one returning with its context extended."""
        rows, max_len, turn_tokens = self.shape
        if not 0 < limit <= turn_tokens or len(context) + limit > max_len:
            raise ValueError(
                f"a turn of {limit} tokens after {len(context)} does not fit rows of {max_len} "
                f"tokens, turns of {turn_tokens}"
            )
        if any(w.key == key for w in self.waiting) or self.row_of.get(key) in self.active:
            raise ValueError(f"{key!r} already has a turn under way")
        self.waiting.append(Waiting(key, list(context), limit, group))

    def release(self, key) -> None:
        row = self.row_of.pop(key)
        del self.key_of[row], self.contexts[row]
        self.free.append(row)

    def admit(self) -> list[Admission]:
        """The waiting turns that have a row (their own, or a free one) -> what each prefills; the
        rest wait."""
        admitted, self.waiting = self._take_rows(self.waiting)
        return [
            Admission(row, *self._extension(row, item), item.group, item.limit)
            for row, item in admitted
        ]

    def started(self, admitted: list[Admission], ended: list[bool]) -> list[int]:
        """Each admitted turn sampled its first token; those not `ended` by it decode -> the rows
        whose turn it ended."""
        for admission, done in zip(admitted, ended):
            if not done:
                self.active.append(admission.row)
                self.left[admission.row] = admission.limit - 1
        return [admission.row for admission, done in zip(admitted, ended) if done]

    def decode_steps(self, ignore_eos: bool, check_every: int, look_every: int | None) -> int:
        """Decode steps before the next look at which turns ended: `check_every`, or without stop
        tokens (no turn ends before its limit) to the first that ends; at most to the last's end
        and `look_every`."""
        left = [self.left[row] for row in self.active]
        return min(min(left) if ignore_eos else check_every, max(left), look_every or max(left))

    def decoded(self, steps: int, done: list[bool]) -> list[int]:
        """The active rows decoded `steps` tokens; those whose turn ended (`done`, one per active
        row) leave the decode batch -> those rows."""
        for row in self.active:
            self.left[row] -= steps
        ended = [row for row, d in zip(self.active, done) if d]
        self.active = [row for row, d in zip(self.active, done) if not d]
        return ended

    def cut(self) -> list[int]:
        """Every turn under way ends where it is (a partial rollout's round ends) -> the rows
        decoding; turns still waiting for a row are dropped."""
        rows, self.active, self.waiting = self.active, [], []
        return rows

    def finish(self, row: int, ids: list[int], log_probs: list[float]) -> Finished:
        """The ended turn of `row`: its tokens join the row's context."""
        self.contexts[row] = self.contexts[row] + ids
        self.left.pop(row, None)
        return Finished(self.key_of[row], ids, log_probs)

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


class CopiedPrefixes:
    """Which rows' first columns are a copy of another row's (a prompt's samples, copied from its
    one prefill), for as long as both rows hold those columns: the decode kernel reads them in the
    row they were copied from, one prompt's keys and values for all its samples."""

    def __init__(self):
        # row -> (the row its first columns are a copy of, how many); source row -> its copies
        self.source_of: dict[int, tuple[int, int]] = {}
        self.copies_of: dict[int, set[int]] = {}

    def update(
        self, items: list[tuple[int, int, list[int], object]], copies: list[tuple[int, int]]
    ) -> dict[int, tuple[int, int]]:
        """After the prefill of `items` (row, start, tokens, group), in which each of `copies`
        (row, source) took a copy of its source's tokens -> (source, length) of every row whose
        entry changed: its own and 0 where it no longer copies one. A copy ends where either row's
        columns within it are written again."""
        changed = {}
        for row, start, *_ in items:
            for member in [row, *self.copies_of.get(row, ())]:
                source, length = self.source_of.get(member, (member, 0))
                if start < length:
                    del self.source_of[member]
                    self.copies_of[source].discard(member)
                    changed[member] = (member, 0)
        width = {row: len(new) for row, _, new, _ in items}
        for row, source in copies:
            self.source_of[row] = changed[row] = (source, width[row])
            self.copies_of.setdefault(source, set()).add(row)
        return changed


def share_prefill(
    items: list[tuple[int, int, list[int], object]],
) -> tuple[list[Piece], list[int], list[tuple[int, int]]]:
    """Of each (row, start, tokens, group): the rows that begin one group's same context are
    prefilled once -> (the pieces to prefill, each item's index in them, (row, the row whose KV it
    copies) for the others)."""
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
    copies = [(row, unique[i][0]) for (row, *_), i in zip(items, source) if unique[i][0] != row]
    return unique, source, copies


def chunk(pieces: list[Piece], budget: int) -> tuple[list[Piece], list[Piece]]:
    """Chunked prefill: (the leading pieces of extensions longer than `budget`, one pass each and
    in this order; the last piece of every extension)."""
    leading, last = [], []
    for row, start, new in pieces:
        while len(new) > budget:
            leading.append((row, start, new[:budget]))
            start, new = start + budget, new[budget:]
        last.append((row, start, new))
    return leading, last


def passes(pieces: list[Piece], budget: int) -> list[list[int]]:
    """Indices of `pieces` per prefill pass, each pass within `budget` new tokens (and its keys
    within KEYS_PER_PASS budgets); pieces of similar widths share a pass."""
    order = sorted(range(len(pieces)), key=lambda i: -len(pieces[i][2]))
    grouped, current = [], []
    for i in order:
        if current and not fits([pieces[j] for j in current + [i]], budget):
            grouped.append(current)
            current = []
        current.append(i)
    grouped.append(current)
    return grouped


def fits(pieces: list[Piece], budget: int) -> bool:
    widest = max(len(new) for _, _, new in pieces)
    furthest = max(start + len(new) for _, start, new in pieces)
    return len(pieces) * widest <= budget and len(pieces) * furthest <= KEYS_PER_PASS * budget
