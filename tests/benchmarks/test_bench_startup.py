"""bench_startup: a one-round run writes every phase; bad counts stop it before anything runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_startup.py"


def run(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PUNICA_X_RESULTS=str(tmp_path / "results"))
    return subprocess.run(
        [sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=300, env=env
    )


@pytest.mark.slow
def test_a_round_writes_every_phase(tmp_path):
    done = run(tmp_path, "--rounds", "1", "--no-reader", "--dtype", "float32")
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = (tmp_path / "results").glob("*/bench_startup.json")
    report = json.loads(path.read_text())
    rows = {r["phase"]: r for r in report["rows"]}
    assert set(rows) == {"import", "load", "first_token", "process total", "header (gguf_header)"}
    for r in rows.values():
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"] and r["rounds"] == 1
    assert rows["process total"]["median_s"] >= rows["load"]["median_s"]
    assert report["summary"]["dtype"] == "float32"
    assert report["summary"]["invariant"].startswith(("auto: ", "batch_invariant="))
    assert (path.parent / "bench_startup.png").exists()


@pytest.mark.parametrize("flags", [("--rounds", "0"), ("--threads", "-1"), ("--rounds", "x")])
def test_bad_counts_exit_2(tmp_path, flags):
    done = run(tmp_path, *flags)
    assert done.returncode == 2 and "--" in done.stderr
    assert not (tmp_path / "results").exists()
