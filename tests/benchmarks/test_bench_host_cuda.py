"""bench_host_cuda (scripts/gpu_check.sh's `host` step) refuses bad flags; its whole path runs
on the CPU in test_gpu_check's dry run."""

from __future__ import annotations

import pytest
from conftest import BENCHMARKS

SCRIPT = BENCHMARKS / "bench_host_cuda.py"


@pytest.mark.parametrize(
    "flags",
    [
        ["--batches", "0"],
        ["--batches", "1,x"],
        ["--batches", "5000"],
        ["--batches", ""],
        ["--steps", "0"],
        ["--steps", "1001"],
        ["--max-tokens", "0"],
        ["--max-tokens", "10"],  # no room for the warm-up and 16 timed steps
        ["--adapters", "0"],
        ["--adapters", "65"],
        ["--device", "cpu"],  # the CPU only as the GPU path's --dry-run
        ["--dry-run"],  # with --device cuda
        ["--device", "tpu"],
    ],
)
def test_bad_flags_exit_2(refused, flags):
    import bench_host_cuda

    err = refused(bench_host_cuda.parse_args, SCRIPT, flags)
    assert flags[0] in err
