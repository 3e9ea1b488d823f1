"""bench_quant_kernel runs end to end at toy size: every mode's figures in its JSON; bad
counts exit 2 naming the flag."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_quant_kernel.py"


def run(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PUNICA_X_RESULTS=str(tmp_path))
    return subprocess.run(
        [sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=300, env=env
    )


def test_a_small_run_writes_every_mode(tmp_path):
    flags = ["--model", "smollm2", "--formats", "Q4_1", "--rows", "1", "2", "--rounds", "1"]
    done = run(tmp_path, *flags, "--layers", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = tmp_path.glob("*/bench_quant_kernel_smollm2.json")
    report = json.loads(path.read_text())
    assert report["stream_GB_s"] > 0 and report["rows"]
    for row in report["rows"]:
        assert row["format"] == "Q4_1" and row["rows"] in (1, 2)
        for mode in ("float", "int16", "int8"):
            assert row[mode + "_ms"] > 0 and row[mode + "_GB_s"] > 0
    assert path.with_suffix(".png").exists()


def test_bad_counts_exit_2(tmp_path):
    for flags, named in ((["--layers", "0"], "--layers"), (["--rows", "0"], "--rows")):
        done = run(tmp_path, *flags)
        assert done.returncode == 2 and named in done.stderr, done.stderr
