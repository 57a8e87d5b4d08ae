"""The native engine's scheduler, driven without a model: plain Python values in, the rows, turns,
budgets and prefill passes a user of the engine relies on out."""

import ast
from pathlib import Path

import pytest

from keel.rollout.native import scheduler as scheduling
from keel.rollout.native.scheduler import (
    CopiedPrefixes,
    Scheduler,
    chunk,
    passes,
    share_prefill,
)


def test_the_scheduler_imports_no_tensor_library():
    """It can be read, tested and reasoned about without a device."""
    tree = ast.parse(Path(scheduling.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses"}


def test_turns_beyond_the_rows_wait_and_take_the_rows_that_are_released():
    s = Scheduler((2, 32, 8))
    for key in "abc":
        s.add(key, [1, 2, 3], 4)
    assert s.busy and s.runnable
    first = s.admit()
    # two rows: the third turn waits
    assert [s.key_of[a.row] for a in first] == ["a", "b"] and [w.key for w in s.waiting] == ["c"]
    # both turns end at their first token; their sequences keep the rows until released
    for row in s.started(first, [True, True]):
        s.finish(row, [9], [-0.5])
    assert s.busy and not s.runnable
    s.release("a")
    assert s.runnable
    (c,) = s.admit()
    assert c.row == first[0].row and (c.start, c.new) == (0, [1, 2, 3]) and not s.waiting


def test_a_returning_sequence_prefills_only_what_follows_its_cached_columns():
    """A turn that ended keeps its row; the next turn of that key prefills from its last sampled
    token on (that token is not in the cache yet), and must extend what it generated."""
    s = Scheduler((1, 64, 8))
    s.add("k", [1, 2, 3], 4)
    (admitted,) = s.admit()
    assert (admitted.start, admitted.new) == (0, [1, 2, 3])
    # the first token did not end the turn; then 3 more steps ended it
    assert s.started([admitted], [False]) == []
    assert s.decoded(3, [True]) == [admitted.row] and not s.active
    finished = s.finish(admitted.row, [7, 8, 9, 10], [-0.1] * 4)
    assert finished.key == "k" and finished.ids == [7, 8, 9, 10]
    assert s.holds("k") and not s.busy

    s.add("k", [1, 2, 3, 7, 8, 9, 10, 20, 21], 4)
    (again,) = s.admit()
    # cached: the context and the sampled tokens but the last, which the next step would write
    assert again.row == admitted.row and (again.start, again.new) == (6, [10, 20, 21])

    s.started([again], [True])
    s.finish(again.row, [30], [-0.2])
    s.add("k", [1, 2, 99], 4)
    with pytest.raises(RuntimeError, match="must extend"):
        s.admit()


def test_turn_budgets_and_how_many_steps_run_between_looks():
    """Without stop tokens no turn ends before its limit: decode to the first that ends. With them,
    look every `check_every` steps; never past the last turn's end, nor `look_every`."""
    s = Scheduler((4, 64, 16))
    s.add("short", [1], 5)
    s.add("long", [2], 12)
    admitted = s.admit()
    assert s.started(admitted, [False, False]) == []
    # the first token was one of each turn's limit
    assert s.decode_steps(ignore_eos=True, check_every=16, look_every=None) == 4
    assert s.decode_steps(ignore_eos=False, check_every=2, look_every=None) == 2
    assert s.decode_steps(ignore_eos=False, check_every=16, look_every=None) == 11
    assert s.decode_steps(ignore_eos=True, check_every=16, look_every=3) == 3
    assert s.decoded(4, [True, False]) == [admitted[0].row]
    assert s.active == [admitted[1].row]
    s.finish(admitted[0].row, [5] * 5, [0.0] * 5)
    assert s.decode_steps(ignore_eos=True, check_every=16, look_every=None) == 7


def test_a_turn_that_does_not_fit_is_refused_before_it_is_queued():
    s = Scheduler((4, 40, 8))
    for context, limit in (([5] * 10, 9), ([5] * 35, 8), ([5] * 10, 0)):
        with pytest.raises(ValueError):
            s.add("a", context, limit)
    s.add("a", [5] * 10, 8)
    with pytest.raises(ValueError, match="under way"):
        s.add("a", [5] * 10, 8)
    assert [w.key for w in s.waiting] == ["a"]


def test_cut_ends_the_decoding_turns_and_drops_the_waiting_ones():
    """A partial rollout's round ends: rows decoding are read where they are, waiting turns go."""
    s = Scheduler((1, 32, 8))
    s.add("a", [1, 2], 8)
    s.add("b", [3, 4], 8)
    (a,) = s.admit()
    s.started([a], [False])
    assert s.cut() == [a.row]
    assert not s.busy and not s.waiting
    cut = s.finish(a.row, [9, 9], [-1.0, -1.0])
    assert cut.key == "a" and s.contexts[a.row] == [1, 2, 9, 9]


def test_reset_frees_every_row():
    s = Scheduler((3, 32, 8))
    s.add("a", [1], 2)
    s.admit()
    s.reset()
    assert not s.busy and not s.holds("a") and sorted(s.free) == [0, 1, 2]


def test_a_group_s_same_first_context_is_prefilled_once_and_copied():
    items = [
        (0, 0, [1, 2, 3], "g"),
        (1, 0, [1, 2, 3], "g"),
        (2, 0, [1, 2, 3], None),
        (3, 4, [5], "g"),
    ]
    unique, source, copies = share_prefill(items)
    # row 1 shares row 0's prefill; the ungrouped one and the returning one are their own
    assert unique == [(0, 0, [1, 2, 3]), (2, 0, [1, 2, 3]), (3, 4, [5])]
    assert source == [0, 0, 1, 2] and copies == [(1, 0)]


def test_a_copied_prompt_is_read_in_its_source_row_until_either_row_writes_within_it():
    """The decode kernel reads a sample's copied prompt in the row it was copied from: for as long
    as both rows still hold it. A row that begins again, or a turn written over the copied columns,
    ends it; a turn after them does not."""
    prefixes = CopiedPrefixes()
    group = [(row, 0, [7, 8, 9], "g") for row in range(4)]
    assert prefixes.update(group, share_prefill(group)[2]) == {r: (0, 3) for r in (1, 2, 3)}
    # multi-turn: the source's and a copy's next turns go after the prompt's 3 columns
    assert prefixes.update([(0, 5, [1, 2], None), (2, 3, [4], None)], []) == {}
    # a copy that begins again (a new sequence in its row) ends only its own entry
    assert prefixes.update([(3, 0, [5, 5], None)], []) == {3: (3, 0)}
    # the source row taken by another sequence: every copy of it reads its own columns again
    assert prefixes.update([(0, 0, [6], None)], []) == {1: (1, 0), 2: (2, 0)}
    assert prefixes.source_of == {}
    # a returning sequence prefilled again from within the copied columns
    prefixes.update(group, share_prefill(group)[2])
    assert prefixes.update([(1, 2, [9, 1], None)], []) == {1: (1, 0)}


def test_prefill_packs_passes_within_the_budget_and_chunks_longer_extensions():
    leading, last = chunk([(0, 0, list(range(10))), (1, 3, [1, 2])], budget=4)
    # the long extension's leading pieces first, each a pass of its own
    assert leading == [(0, 0, [0, 1, 2, 3]), (0, 4, [4, 5, 6, 7])]
    assert last == [(0, 8, [8, 9]), (1, 3, [1, 2])]
    pieces = [(0, 0, [1] * 3), (1, 0, [1] * 1), (2, 0, [1] * 2), (3, 0, [1] * 2)]
    grouped = passes(pieces, budget=4)
    assert sorted(i for p in grouped for i in p) == [0, 1, 2, 3]
    for p in grouped:
        assert len(p) * max(len(pieces[i][2]) for i in p) <= 4
    # widest first
    assert grouped[0] == [0]
