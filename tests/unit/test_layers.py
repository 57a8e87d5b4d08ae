"""Imports run one way, down the layers (docs/architecture.md, ../shared/DESIGN.md): a module never
imports from a layer above its own, and no two folders import each other. Every import in keel/ is
read, those inside functions too."""

import ast
from collections import defaultdict
from pathlib import Path

KEEL = Path(__file__).parents[2] / "keel"

# Bottom first. A name is a folder or a top-level module of keel/.
LAYERS = [
    {"errors", "types", "openmp"},
    {"config", "algorithms"},
    {"data", "models", "rewards", "rollout", "training", "observe", "checkpoint"},
    {"distributed"},
    {"trainer"},
    {"check"},
    {
        "api",
        "cli",
        "commands",
        "demo",
        "demo_result",
        "demo_tools",
        "bench",
        "__main__",
        "__init__",
    },
]
LAYER = {name: level for level, names in enumerate(LAYERS) for name in names}


def imports() -> dict[tuple[str, str], set[str]]:
    """(importing part, imported part) -> the files where it happens."""
    found = defaultdict(set)
    for file in KEEL.rglob("*.py"):
        part = file.relative_to(KEEL).parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = (
                    [f"keel.{a.name}" for a in node.names]
                    if node.module == "keel"
                    else [node.module]
                )
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            for module in modules:
                bits = module.split(".")
                if bits[0] == "keel" and len(bits) > 1 and bits[1] != part and bits[1] in LAYER:
                    found[(part, bits[1])].add(str(file.relative_to(KEEL.parent)))
    return found


def test_every_part_of_keel_has_a_layer():
    parts = {
        p.name.removesuffix(".py")
        for p in KEEL.iterdir()
        if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    assert parts <= set(LAYER), f"give these a layer: {sorted(parts - set(LAYER))}"


def test_no_module_imports_from_a_layer_above_its_own():
    found = imports()
    upward = {
        edge: sorted(files) for edge, files in found.items() if LAYER[edge[1]] > LAYER[edge[0]]
    }
    assert not upward, f"imports from a layer above: {upward}"


def test_no_two_folders_import_each_other():
    found = imports()
    both_ways = sorted((a, b) for a, b in found if (b, a) in found and a < b)
    assert not both_ways, f"two-way imports: {both_ways}"


MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_CLASS_LINES = 400, 60, 250


def test_no_file_over_400_lines_and_no_function_over_60():
    """Small files and functions: one job each, read at a glance (docs/architecture.md)."""
    long_files, long_functions = [], []
    for file in KEEL.rglob("*.py"):
        text = file.read_text()
        name = str(file.relative_to(KEEL.parent))
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(f"{name} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}:{node.lineno} {node.name} ({length} lines)")
    assert not long_files, f"files over {MAX_FILE_LINES} lines: {long_files}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def test_no_class_over_250_lines():
    """A class of short methods is still one thing to hold in mind: past the cap, a responsibility
    of its own (saving, validation, reporting) belongs in a collaborator (docs/architecture.md)."""
    long_classes = []
    for file in KEEL.rglob("*.py"):
        name = str(file.relative_to(KEEL.parent))
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ClassDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_CLASS_LINES:
                    long_classes.append(f"{name}:{node.lineno} {node.name} ({length} lines)")
    assert not long_classes, f"classes over {MAX_CLASS_LINES} lines: {long_classes}"
