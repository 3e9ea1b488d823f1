"""repeat_summary: median and range of each figure over repeated runs' records; records of
another machine or command, and fewer than 3 runs, are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "repeat_summary.py"
MACHINE = {"cpu": "x", "cpu_simd": [], "isa": "avx2", "cores": 2, "torch": "t", "threads": 2}


def record(path: Path, tok: list[float], machine=MACHINE, args=None) -> Path:
    rows = [{"workload": w, "ours_tok_s": t, "x_vllm": t / 100} for w, t in zip(("a", "b"), tok)]
    path.write_text(json.dumps({"machine": machine, "args": args or {"r": 3}, "rows": rows}))
    return path


def run(tmp_path, *paths: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PUNICA_X_RESULTS=str(tmp_path / "results"))
    argv = [sys.executable, str(SCRIPT), "summary", *map(str, paths), "--group", "g"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)


def test_median_and_range_of_each_figure(tmp_path):
    runs = [
        record(tmp_path / f"r{i}.json", t) for i, t in enumerate([[300, 10], [100, 30], [200, 20]])
    ]
    done = run(tmp_path, *runs)
    assert done.returncode == 0, done.stderr
    out = json.loads((tmp_path / "results" / "g" / "summary.json").read_text())
    assert out["runs"] == ["r0.json", "r1.json", "r2.json"]
    a, b = out["rows"]
    assert a["ours_tok_s"] == "200.00 [100.00-300.00]" and a["ours_tok_s_runs"] == [300, 100, 200]
    assert b["x_vllm"] == "0.20 [0.10-0.30]"
    assert "vllm_tok_s" not in a  # a column no record holds is left out
    assert (tmp_path / "results" / "g" / "summary.png").stat().st_size > 0


def test_another_machine_or_command_or_too_few_runs_are_refused(tmp_path):
    same = [record(tmp_path / f"r{i}.json", [1, 2]) for i in range(2)]
    other = record(tmp_path / "o.json", [1, 2], machine={**MACHINE, "cores": 16})
    done = run(tmp_path, *same, other)
    assert done.returncode != 0 and "another machine or command" in done.stderr
    command = record(tmp_path / "c.json", [1, 2], args={"r": 5})
    assert "another machine or command" in run(tmp_path, *same, command).stderr
    assert "at least 3 runs" in run(tmp_path, *same).stderr
