"""docs/config.md renders as tables: every row has its header's number of cells."""

import re
from pathlib import Path

from keel.config.docs import render_reference

DOC = Path(__file__).parents[2] / "docs" / "config.md"


def cells(row: str) -> int:
    """Cells of a markdown table row: its pipes, less the escaped ones (`\\|` is text), less one."""
    return len(re.findall(r"(?<!\\)\|", row)) - 1


def tables(text: str) -> list[list[str]]:
    found, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            found, current = found + [current], []
    return found + [current] if current else found


def test_every_row_of_the_config_reference_has_its_tables_number_of_cells():
    for text in (render_reference(), DOC.read_text()):
        found = tables(text)
        # RL keys, SFT keys, verl's keys, different defaults
        assert len(found) >= 4
        for table in found:
            width = cells(table[0])
            bad = [row for row in table if cells(row) != width]
            assert not bad, f"rows that do not have {width} cells (a bare | in a cell?): {bad[:3]}"


def test_a_pipe_in_a_keys_help_is_escaped_not_a_new_cell():
    row = next(
        line
        for line in render_reference().splitlines()
        if line.startswith("| `trainer.resume_mode`")
    )
    assert cells(row) == 5 and "auto \\| disable" in row
