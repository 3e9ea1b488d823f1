"""bench_host runs end to end at toy size on the simulated device, and refuses bad flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import BENCHMARKS

SCRIPT = BENCHMARKS / "bench_host.py"


@pytest.mark.slow
def test_a_toy_run_reports_every_batch(tmp_path):
    """Both scheduling modes, offline and through the server from both runner backends."""
    flags = ["--batches", "4", "--max-tokens", "6", "--adapters", "2", "--rank", "4"]
    flags += ["--step-ms", "2", "--name", "toy_host", "--overlap", "both", "--server"]
    flags += ["--stream-intervals", "1,3"]
    env = dict(os.environ, PUNICA_X_RESULTS=str(tmp_path / "results"))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = (tmp_path / "results").glob("*/toy_host.json")
    report = json.loads(path.read_text())
    rows = report["rows"]
    assert [(r["batch"], r["overlap"]) for r in rows] == [(4, "off"), (4, "on")]
    served = [(r["overlap"], r["backend"], r["stream_interval"]) for r in report["server_rows"]]
    assert served == [
        (o, b, n) for o in ("off", "on") for b in ("thread", "process") for n in (1, 3)
    ]
    for r in report["server_rows"]:
        assert r["server_tok_s"] > 0 and r["x_offline"] > 0 and r["all_started_ms"] > 0
        assert r["tokens_per_event"] > 0
    for r in rows:
        assert r["decode_steps"] == 5  # 6 tokens: the first comes from the prefill step
        assert r["step_ms"] >= 2.0 and r["device_ms"] == 2.0
        assert 0 < r["host_ms"] < r["step_ms"]
        assert r["step_over_bound"] >= 0.99


@pytest.mark.parametrize(
    "flags",
    [
        ["--batches", "0"],
        ["--batches", "1,x"],
        ["--batches", "5000"],
        ["--step-ms", "0"],
        ["--step-ms", "nan"],
        ["--step-ms", "inf"],
        ["--max-tokens", "0"],
        ["--adapters", "-1"],
        ["--runner-backends", "ray"],
        ["--runner-backends", ""],
        ["--stream-intervals", "0"],
        ["--stream-intervals", "1,x"],
    ],
)
def test_bad_flags_exit_2(refused, flags):
    import bench_host

    err = refused(bench_host.parse_args, SCRIPT, flags)
    assert flags[0] in err
