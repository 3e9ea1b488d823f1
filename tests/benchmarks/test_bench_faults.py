"""bench_faults: how each request's outcome is judged, bad flags refused, and (-m long) a
short campaign of both phases in which no request is lost, broken, truncated or wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from common.fault_clients import BAD, Record, judge

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_faults.py"


def record(status: int, text: str = "", error: str | None = None) -> Record:
    return Record(0, 0.0, 1.0, status, text, error)


@pytest.mark.parametrize(
    ("rec", "outcome"),
    [
        (record(200, "the answer"), "ok"),
        (record(503, error="generation_unavailable"), "refused"),  # nothing generated
        (record(200, "the ans", error="generation_unavailable"), "failed"),  # error event
        (record(500, error="generation_failed"), "failed"),
        (record(429, error="too_many_requests"), "refused"),
        (record(-1, "the", error="timeout"), "lost"),
        (record(-3, "the"), "lost"),  # a stream that ended without [DONE] or an error
        (record(-2, "the", error="RemoteProtocolError: peer closed"), "broken"),
        (record(500, error="internal_error"), "broken"),
        (record(200, "the ans"), "truncated"),
        (record(200, "another answer"), "wrong"),
    ],
)
def test_each_way_a_request_ends_is_judged(rec, outcome):
    assert judge(rec, "the answer") == outcome
    assert (outcome in BAD) is (outcome in ("lost", "broken", "truncated", "wrong"))


@pytest.mark.parametrize(
    "flags",
    [["--gap", "5"], ["--gap", "9,3"], ["--gap", "a,b"], ["--gap", "0,1"], ["--minutes", "0"],
     ["--streams", "0"], ["--phases", "lamina,nope"], ["--max-tokens", "-1"]],
)  # fmt: skip
def test_bad_flags_are_refused(refused, flags):
    import bench_faults

    assert "error" in refused(bench_faults.main, SCRIPT, flags)


@pytest.mark.long
def test_a_short_campaign_loses_nothing(tmp_path):
    env = dict(os.environ, PUNICA_X_RESULTS=str(tmp_path / "results"))
    flags = ["--minutes", "1.5", "--streams", "16", "--gap", "5,8", "--seed", "7"]
    done = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True,
                          text=True, timeout=1800, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = (tmp_path / "results").glob("*/bench_faults.json")
    report = json.loads(path.read_text())
    assert report["summary"] == dict.fromkeys(BAD, 0), report["outcomes"]
    injected = {(f["phase"], f["fault"]): f["injected"] for f in report["faults"]}
    assert all(n >= 1 for (_, kind), n in injected.items() if kind != "disk_full"), injected
    assert sum(r["ok"] for r in report["outcomes"]) > 100
