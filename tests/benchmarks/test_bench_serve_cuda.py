"""bench_serve_cuda runs `punica-x serve` end to end (here on the CPU with the tiny Llama):
every figure of its summary in the JSON, the server stopped and its scratch folder gone
afterwards; bad flags exit 2 naming the flag, before anything starts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serve_cuda.py"
sys.path.insert(0, str(SCRIPT.parent))
from bench_serve_cuda import COLUMNS as FIGURES  # noqa: E402  every figure of the table


def run(*flags: str, env: dict | None = None, timeout: float = 60):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_a_cpu_run_writes_every_figure_and_stops_the_server(tmp_path, tiny_model_dir):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    # Backend timing is the engine's business (tests/punica_x/ops); with a cold autotune
    # cache on a slow CI machine it made the server's start alone take over a minute.
    env = dict(
        os.environ,
        PUNICA_X_RESULTS=str(tmp_path / "results"),
        TMPDIR=str(scratch),
        PUNICA_X_AUTOTUNE="0",
    )
    flags = ["--device", "cpu", "--model", str(tiny_model_dir), "--adapters", "2"]
    flags += ["--requests", "4", "--clients", "2", "--max-tokens", "4", "--timeout-s", "240"]
    # The script's own wait (240 s, then the server log in its error) ends before ours.
    done = run(*flags, env=env, timeout=360)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    (path,) = (tmp_path / "results").glob("*/bench_serve_cuda_*.json")
    summary = json.loads(path.read_text())["summary"]
    for name in FIGURES:
        value = summary[name]
        assert isinstance(value, float) and value > 0, (name, value)
    assert summary["new_first_event"] in ("text", "logprobs")
    assert summary["metrics"] and all(k.startswith("punica_x_") for k in summary["metrics"])
    assert isinstance(summary["server_log"], list) and "error" not in summary
    assert path.with_suffix(".png").exists()

    pid = int(re.search(r"server ready in .* \(pid (\d+)\)", done.stdout).group(1))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not list(scratch.glob("bench-serve-cuda-*"))  # adapters and server data removed


BAD = [
    (["--device", "cpu", "--requests", "0"], "--requests"),
    (["--device", "cpu", "--clients", "-1"], "--clients"),
    (["--device", "cpu", "--adapters", "0"], "--adapters"),
    (["--device", "cpu", "--max-tokens", "0"], "--max-tokens"),
    (["--device", "cpu", "--model", "some/dir", "--tokenizer", "x"], "--tokenizer"),
]
if not torch.cuda.is_available():
    BAD.append((["--device", "cuda"], "--device cuda"))


@pytest.mark.parametrize("flags,named", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_values_exit_2_naming_the_flag(flags, named, refused):
    import bench_serve_cuda

    assert named in refused(bench_serve_cuda.parse_args, SCRIPT, flags)


def test_the_script_exits_2_before_anything_starts():
    done = run("--device", "cpu", "--requests", "0", timeout=60)
    assert done.returncode == 2 and "--requests" in done.stderr, done.stderr
