"""The CUDA SGMV kernels compile with the installed nvcc for the architectures we ship."""

import shutil
import subprocess
from pathlib import Path

import pytest

from punica_x.ops._build import CSRC, CUDA_ARCHS

NVCC = shutil.which("nvcc") or next(
    (str(p) for p in Path("/usr/local").glob("cuda*/bin/nvcc") if p.exists()), None
)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", CUDA_ARCHS)
def test_cuda_kernels_compile(tmp_path, arch):
    out = tmp_path / f"sgmv_sm{arch}.o"
    cmd = [
        NVCC,
        "-std=c++17",
        "-O3",
        f"-arch=sm_{arch}",
        "-c",
        str(CSRC / "sgmv_cuda.cu"),
        "-o",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    symbols = subprocess.run(["nm", "-C", str(out)], capture_output=True, text=True).stdout
    assert "punica_x::sgmv_shrink_cuda" in symbols
    assert "punica_x::sgmv_expand_cuda" in symbols
