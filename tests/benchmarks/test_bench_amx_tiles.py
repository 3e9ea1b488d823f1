"""bench_amx_tiles refuses what it cannot measure: bad counts, a tokenizer without a model
shape, and (without --emulated) a CPU without AMX tiles, each with exit 2 and the flag named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_amx_tiles.py"


def run(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--rounds", "0", "--emulated"], "--rounds"),
        (["--min-rows", "-3", "--emulated"], "--min-rows"),
        (["--decode-steps", "0", "--emulated"], "--decode-steps"),
        (["--tokenizer", "x", "--emulated"], "--tokenizer"),
        (["--rounds", "1e3"], "--rounds"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(flags, named, refused):
    import bench_amx_tiles

    assert named in refused(bench_amx_tiles.parse_args, SCRIPT, flags)


def test_without_amx_it_asks_for_emulated():
    from punica_x.ops.sgmv import cpu_backend

    if cpu_backend().module.amx_available():
        pytest.skip("this CPU has AMX tiles")
    done = run("--rounds", "1")
    assert done.returncode == 2 and "--emulated" in done.stderr, done.stderr
