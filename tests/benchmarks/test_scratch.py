"""A benchmark's scratch folder goes when its process ends, normally or by an exception
(benchmarks write 0.3-1 GB of adapters there; kept, they filled a VM's disk)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

CHILD = """
import sys
sys.path.insert(0, {benchmarks!r})
from common.scratch import scratch_dir
path = scratch_dir("px-scratch-test-")
(path / "adapters" / "a0").mkdir(parents=True)
(path / "adapters" / "a0" / "weights.bin").write_bytes(b"x" * 4096)
print(path, flush=True)
if {fail}:
    raise RuntimeError("the benchmark failed")
"""


@pytest.mark.parametrize("fail", [False, True])
def test_the_scratch_folder_is_removed_when_the_process_exits(fail):
    child = CHILD.format(benchmarks=str(BENCHMARKS), fail=fail)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert (done.returncode != 0) == fail, done.stderr
    path = Path(done.stdout.strip())
    assert path.name.startswith("px-scratch-test-")
    assert not path.exists()


def test_no_benchmark_makes_a_temp_folder_it_leaves_behind():
    offenders = [
        str(p.relative_to(BENCHMARKS))
        for p in BENCHMARKS.rglob("*.py")
        if "mkdtemp(prefix=" in p.read_text() and p.name != "scratch.py"
    ]
    assert offenders == []
