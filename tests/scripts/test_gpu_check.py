"""scripts/gpu_check.sh: the one command a lent GPU machine runs. Here its --dry-run (every
step on the CPU at toy sizes) end to end, and the step runner's timeouts and budget."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_dry_run_end_to_end(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--dry-model", str(tiny_model_dir)]
        + ["--tokenizer", str(tiny_model_dir), "--results", str(out), "--budget-s", "400"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "where the minutes went" in proc.stdout
    report = json.loads((out / "gpu_check.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    names = ["env", "build", "gpu_tests", "host", "bench_generate", "bench_sgmv", "serve"]
    names.append("invariance")
    assert list(steps) == names
    assert all(s["status"] == "ok" and s["seconds"] > 0 for s in steps.values())
    assert steps["env"]["figures"]["gpu"] is None  # no CUDA here
    tests = steps["gpu_tests"]["figures"]
    assert tests["tests"] > 0 and tests["skipped"] == tests["tests"]  # collected, skipped
    rows = steps["bench_generate"]["figures"]["rows"]
    assert {r["workload"] for r in rows} >= {"backbone", "distinct"}
    assert all(r["tok_s"] > 0 for r in rows)
    host = steps["host"]["figures"]
    assert [r["batch"] for r in host["rows"]] == [1, 4]
    assert all(r["step_ms"] > 0 and r["floor_ms"] > 0 and r["overlap_ms"] > 0 for r in host["rows"])
    assert host["summary"]["copy_GB_s"] > 0 and host["summary"]["top_host_costs"]
    sgmv = steps["bench_sgmv"]["figures"]["rows"]
    assert {r["workload"] for r in sgmv} >= {"distinct", "identical"}
    assert all(r["sgmv_ms"] > 0 for r in sgmv)
    serve = steps["serve"]["figures"]["summary"]
    assert serve["distinct_tok_s"] > 0 and serve["new_first_token_s"] > 0
    invariant = steps["invariance"]["figures"]
    assert invariant["summary"]["batch_invariant"] == "batch_invariant=on"
    assert {r["workload"] for r in invariant["rows"]} == {r["workload"] for r in rows}
    md = (out / "gpu_check.md").read_text()
    assert "| bench_generate | ok |" in md and "## serve" in md
    assert "The mode's decode cost" in md
    with tarfile.open(out / "results.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.endswith(".json") and "bench_generate_cuda" in n for n in names)
    assert any(n.endswith(".json") and "bench_serve_cuda" in n for n in names)
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {f"./{s}.log" for s in steps} <= set(tar.getnames())
    # the repo's own results were not touched
    assert not (ROOT / "benchmarks" / "results" / "cuda" / "bench_generate_cuda_tiny.json").exists()


def test_a_step_past_its_timeout_is_killed_with_its_children(tmp_path):
    gc = _module()
    marker = tmp_path / "child-alive"
    script = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30); "
        f'open(r"{marker}", "w").write("x")\'])\n'
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    step = gc.Step("slow", [sys.executable, "-c", script], timeout_s=2)
    t0 = time.monotonic()
    result = gc.run_step(step, tmp_path / "slow.log", seconds_left=100)
    assert result.status == "timeout" and time.monotonic() - t0 < 2 + gc.KILL_GRACE_S + 5
    assert "started" in result.tail
    time.sleep(0.5)
    assert not marker.exists()  # the whole process group went


def test_budget_cuts_a_step_and_skips_what_no_longer_fits(tmp_path):
    gc = _module()
    step = gc.Step("sleepy", [sys.executable, "-c", "import time; time.sleep(30)"], 300)
    result = gc.run_step(step, tmp_path / "a.log", seconds_left=1.5 + gc.MIN_STEP_S)
    assert result.status == "timeout" and result.seconds < 1.5 + gc.MIN_STEP_S + 5
    skipped = gc.run_step(step, tmp_path / "b.log", seconds_left=gc.MIN_STEP_S - 1)
    assert skipped.status == "skipped" and skipped.tail == ["budget spent"]
    failed = gc.run_step(
        gc.Step("bad", [sys.executable, "-c", "raise SystemExit(3)"], 30), tmp_path / "c.log", 100
    )
    assert failed.status == "failed" and failed.returncode == 3
    missing = gc.run_step(gc.Step("gone", ["/nonexistent/prog"], 30), tmp_path / "d.log", 100)
    assert missing.status == "failed"


def test_junit_counts(tmp_path):
    gc = _module()
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="1" skipped="1">'
        '<testcase classname="a" name="ok"/>'
        '<testcase classname="a" name="bad"><failure message="x"/></testcase>'
        '<testcase classname="a" name="err"><error message="y"/></testcase>'
        '<testcase classname="a" name="skip"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    got = gc.junit_counts(xml)
    assert got["passed"] == 1 and got["failed_names"] == ["a::bad", "a::err"]
    assert gc.junit_counts(tmp_path / "none.xml") == {}
    (tmp_path / "broken.xml").write_text("<testsuites")
    assert "error" in gc.junit_counts(tmp_path / "broken.xml")


@pytest.mark.parametrize(
    "bad",
    [
        ["--budget-s", "0"],
        ["--budget-s", "nan"],
        ["--budget-s", "inf"],
        ["--tests-timeout-s", "-1"],
        ["--host-timeout-s", "0"],
        ["--host-timeout-s", "nan"],
        ["--host-batches", "1,x"],
        ["--host-batches", "0"],
        ["--only", "nosuchstep"],
        ["--only", "env,env"],
        ["--only", ""],
    ],
)
def test_bad_arguments_exit_2(bad, tmp_path):
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--dry-run", "--results", str(tmp_path), *bad],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr


def test_only_runs_the_steps_in_the_order_it_names():
    gc = _module()
    steps = gc.steps_for(gc.parse_args(["--dry-run"]), Path("/tmp/w"))
    got = gc.chosen_steps(steps, "env,build,serve,bench_generate")
    assert [s.name for s in got] == ["env", "build", "serve", "bench_generate"]
    with pytest.raises(ValueError, match="unknown steps"):
        gc.chosen_steps(steps, "env,nosuch")
