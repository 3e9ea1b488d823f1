"""Shared by the benchmark scripts' tests."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
# A benchmark's report writes JSON, a PNG and its README section under the results tree:
# tests must never overwrite the committed figures (a test once put its fake rows there).
# Set before any test imports the scripts, so the subprocesses they start inherit it too.
os.environ["PUNICA_X_RESULTS"] = tempfile.mkdtemp(prefix="punica-x-results-")


@pytest.fixture
def refused(monkeypatch, capsys):
    """refused(parse, script, flags) -> stderr of `parse()` (a script's parse_args) run in
    process on those flags, asserting it exits 2 (a subprocess each cost ~2 s)."""

    def run(parse, script: Path, flags: list[str]) -> str:
        monkeypatch.setattr(sys, "argv", [str(script), *flags])
        with pytest.raises(SystemExit) as exit_:
            parse()
        assert exit_.value.code == 2
        return capsys.readouterr().err

    return run
