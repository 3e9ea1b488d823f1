"""The code's shape, checked: imports only go down the layers (frontend -> scheduler ->
punica_x), no module imports one that imports it back (lazy and type-checking imports
included), and no file or function grows past what one reading holds (README's "How we
write code"; issue 30's acceptance: ~400 lines a file, ~60 a function)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("frontend", "scheduler", "punica_x")  # each may import those after it only
MAX_FILE_LINES = 420
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    mods = {}
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project modules `name` imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            targets = subs if len(subs) == len(node.names) else [base, *subs]
        for t in targets:
            while t and t not in MODULES:  # a name inside a module: the module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_imports_only_go_down_the_layers():
    up = [
        f"{m} imports {d}"
        for m, deps in GRAPH.items()
        for d in deps
        if LAYERS.index(d.split(".")[0]) < LAYERS.index(m.split(".")[0])
    ]
    assert not up


PUBLIC_FACE = ("punica_x", "punica_x.api")  # what scheduler/ and frontend/ may import of it


def test_scheduler_and_frontend_use_only_the_runners_public_face():
    """scheduler/ and frontend/ reach punica_x through punica_x/api.py (and the package's
    own names): the runner's internals can change without them (issue 48)."""
    reaches = [
        f"{m} imports {d}"
        for m, deps in GRAPH.items()
        if m.split(".")[0] in ("scheduler", "frontend")
        for d in deps
        if d.split(".")[0] == "punica_x" and d not in PUBLIC_FACE
    ]
    assert not reaches, "\n".join(sorted(reaches))


def test_no_import_circle():
    """Tarjan's strongly connected components over the module graph: none has two modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not circles


def test_the_checker_sees_a_circle_and_an_upward_import():
    """The two checks above would fail on code that has what they forbid."""
    saved = {k: set(v) for k, v in GRAPH.items()}
    try:
        GRAPH["punica_x.config"].add("punica_x.engine.engine")
        with pytest.raises(AssertionError):
            test_no_import_circle()
        GRAPH["punica_x.core"].add("scheduler.cluster")
        with pytest.raises(AssertionError):
            test_imports_only_go_down_the_layers()
    finally:
        GRAPH.clear()
        GRAPH.update(saved)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_files_and_functions_stay_small(name):
    path = MODULES[name]
    text = path.read_text(encoding="utf-8")
    lines = len(text.splitlines())
    assert lines <= MAX_FILE_LINES, f"{path} has {lines} lines"
    long = [
        f"{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path}: {long}"
