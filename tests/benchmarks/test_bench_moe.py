"""bench_moe runs end to end at toy size on a tiny Qwen3-MoE: every workload's row with its
floors, the active experts counted per workload, HF's columns and PEFT's answer to a mixed
batch of expert adapters in its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import make_tiny_family

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_moe.py"


def test_a_toy_run_writes_every_workload(tmp_path):
    model = make_tiny_family(
        tmp_path / "tiny-moe",
        "qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    flags = ["--model", str(model), "--requests", "4", "--max-tokens", "3", "--rank", "4"]
    flags += ["--rounds", "1", "--decode-steps", "2", "--dtype", "float32"]
    env = dict(os.environ, PUNICA_X_RESULTS=str(tmp_path / "results"))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = (tmp_path / "results").glob("*/bench_moe_tiny_moe_float32.json")
    report = json.loads(path.read_text())
    rows = {r["workload"]: r for r in report["rows"]}
    assert set(rows) == {"distinct", "identical", "backbone"}
    for row in rows.values():
        assert row["ours_tok_s"] > 0 and 1 <= row["active_experts"] <= 8
        assert row["step_over_floor"] > 0 and row["read_floor_ms"] > 0
    assert rows["backbone"]["hf_tok_s"] > 0 and rows["identical"]["hf_tok_s"] > 0
    assert "distinct" not in {w for w, r in rows.items() if "hf_tok_s" in r}
    assert "mixed adapter batches" in report["summary"]["hf_mixed_batch"]
