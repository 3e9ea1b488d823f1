"""bench_invariance runs end to end at toy size: every workload's on / off row, paired by
round, and what auto chose, in its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_invariance.py"


def test_a_toy_run_writes_every_workload(tmp_path):
    flags = ["--requests", "4", "--max-tokens", "3", "--rank", "4", "--rounds", "1"]
    flags += ["--decode-steps", "2", "--prefill-tokens", "40", "--dtype", "bfloat16"]
    env = dict(os.environ, PUNICA_X_RESULTS=str(tmp_path / "results"))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = (tmp_path / "results").glob("*/bench_invariance_bfloat16_qauto.json")
    report = json.loads(path.read_text())
    rows = {r["workload"]: r for r in report["rows"]}
    assert set(rows) == {"distinct", "identical", "backbone", "prefill_long", "prefill_batch"}
    for row in rows.values():
        assert row["on_ms"] > 0 and row["off_ms"] > 0 and row["min"] <= row["max"]
    summary = report["summary"]
    assert summary["dtype"] == "bfloat16" and summary["prefill_tokens"] == 40
    assert summary["auto_reason"].startswith("auto: ")
    assert len(report["rounds_ms"]["distinct/on"]) == 1
