"""bench_reproducibility runs end to end at toy size: every check's row for both modes in its
JSON, and with the mode on no completion differs (what the mode promises, on this CPU's
kernels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_reproducibility.py"

CHECKS = ("prefix_hit", "batch_32", "chunked")

pytestmark = pytest.mark.slow


def test_a_toy_run_counts_every_check_in_both_modes(tmp_path):
    flags = ["--max-tokens", "4", "--rank", "4", "--system-repeats", "12"]
    env = dict(os.environ, PUNICA_X_RESULTS=str(tmp_path / "results"))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = (tmp_path / "results").glob("*/bench_reproducibility_bfloat16_qauto.json")
    report = json.loads(path.read_text())
    rows = {(r["check"], r["mode"]): r for r in report["rows"]}
    assert set(rows) == {(c, m) for c in CHECKS for m in ("on", "off")}
    assert [rows[(c, "on")]["compared"] for c in CHECKS] == [9, 32, 9]
    for check in CHECKS:
        assert rows[(check, "on")]["logprobs_differ"] == 0, check
        off = rows[(check, "off")]
        assert 0 <= off["tokens_differ"] <= off["logprobs_differ"] <= off["compared"]
    assert report["summary"]["dtype"] == "bfloat16"
    assert report["summary"]["auto_reason"].startswith("auto: ")
