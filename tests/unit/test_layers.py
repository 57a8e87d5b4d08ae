"""Imports run one way, down the layers (docs/architecture.md, ../shared/DESIGN.md): a module never
imports from a layer above its own, no two folders import each other, and no chain of imports
between files comes back to where it started. Every import in keel/ is read, those inside
functions too: an import moved into a function to dodge a circle is still a circle."""

import ast
from collections import defaultdict
from pathlib import Path

KEEL = Path(__file__).parents[2] / "keel"

# Bottom first. A name is a folder or a top-level module of keel/.
LAYERS = [
    {"errors", "types", "openmp", "version"},
    {"config", "algorithms"},
    {"data", "models", "rewards", "rollout", "training", "observe", "checkpoint", "export"},
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


MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60
MAX_CLASS_LINES, MAX_CLASS_METHODS = 200, 15


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


def test_no_class_over_200_lines_or_15_methods():
    """A class of short methods is still one thing to hold in mind: past the cap, a responsibility
    of its own (saving, validation, reporting) belongs in a collaborator (docs/architecture.md)."""
    large = []
    for file in KEEL.rglob("*.py"):
        name = str(file.relative_to(KEEL.parent))
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ClassDef):
                length = node.end_lineno - node.lineno + 1
                methods = sum(
                    isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body
                )
                if length > MAX_CLASS_LINES or methods > MAX_CLASS_METHODS:
                    large.append(
                        f"{name}:{node.lineno} {node.name} ({length} lines, {methods} methods)"
                    )
    assert not large, (
        f"classes over {MAX_CLASS_LINES} lines or {MAX_CLASS_METHODS} methods: {large}"
    )


def module_of(file: Path) -> str:
    parts = file.relative_to(KEEL.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = KEEL.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def file_imports() -> dict[str, set[str]]:
    """keel module -> the keel modules it names in an import, at the top or inside a function.

    `from a.b import c` names a.b.c where c is a module, else a.b. A package's __init__ is not
    counted as imported by its submodules' importers: only what the code names."""
    graph = {}
    for file in KEEL.rglob("*.py"):
        here = module_of(file)
        named = set()
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = here if file.name == "__init__.py" else here.rsplit(".", 1)[0]
                    package = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{package}.{base}" if base else package
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    named.add(full if is_module(full) else base)
            elif isinstance(node, ast.Import):
                named.update(alias.name for alias in node.names)
        graph[here] = {m for m in named if m.split(".")[0] == "keel" and m != here and is_module(m)}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_import_circle_between_files():
    found = circles(file_imports())
    assert not found, f"import circles (imports inside functions count): {found}"


def test_no_two_files_of_one_folder_import_each_other():
    graph = file_imports()
    both_ways = sorted(
        (a, b)
        for a, targets in graph.items()
        for b in targets
        if a < b and a in graph.get(b, ()) and a.rsplit(".", 1)[0] == b.rsplit(".", 1)[0]
    )
    assert not both_ways, f"files of one folder importing each other: {both_ways}"
