"""Benchmark scripts share code only through benchmarks/common/: no script imports another
script, and nothing in common imports a script (so a script can change its flags, tables or
files without touching the others)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = {p.stem for p in BENCHMARKS.glob("*.py")}
COMMON = {p.stem for p in (BENCHMARKS / "common").glob("*.py")} - {"__init__"}


def imported(path: Path) -> set[str]:
    """Top-level names of every module the file imports, at any depth of the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.name)
def test_a_script_imports_no_other_script(path):
    assert not imported(path) & (SCRIPTS - {path.stem})


@pytest.mark.parametrize("path", sorted((BENCHMARKS / "common").glob("*.py")), ids=lambda p: p.name)
def test_common_imports_no_script(path):
    assert not imported(path) & SCRIPTS
    assert not imported(path) & COMMON, "common modules import each other as common.<module>"


def test_peers_runs_alone_in_the_peer_venv():
    """common/peers.py is also run as a script by the vLLM venv's python, where neither
    benchmarks/ nor punica-x is importable: it imports the standard library, vLLM (in the
    functions that run there) and httpx (in start_server, which runs here)."""
    allowed = set(sys.stdlib_module_names) | {"__future__", "vllm", "httpx"}
    assert imported(BENCHMARKS / "common" / "peers.py") <= allowed
