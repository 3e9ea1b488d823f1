"""The CUDA SGMV kernels compile with the installed nvcc for the architectures we ship, and
the build asks nvcc for the visible GPUs' architectures plus PTX."""

import shutil
import subprocess
from pathlib import Path

import pytest

from punica_x.ops._build import CSRC, CUDA_ARCHS, cuda_archs, gencode_flags

NVCC = shutil.which("nvcc") or next(
    (str(p) for p in Path("/usr/local").glob("cuda*/bin/nvcc") if p.exists()), None
)


def test_the_visible_gpus_architectures_with_ptx(monkeypatch):
    monkeypatch.delenv("PUNICA_X_CUDA_ARCHS", raising=False)
    assert cuda_archs([(9, 0), (8, 0), (9, 0)]) == ("80", "90")
    assert cuda_archs([]) == CUDA_ARCHS  # none visible (a CPU build machine): the defaults
    assert gencode_flags(("80", "90")) == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",  # PTX: newer GPUs JIT it
    ]
    monkeypatch.setenv("PUNICA_X_CUDA_ARCHS", "90, 100")
    assert cuda_archs([(8, 0)]) == ("90", "100")
    for bad in ("sm_90", "9", "90;rm -rf /", "1000"):
        monkeypatch.setenv("PUNICA_X_CUDA_ARCHS", bad)
        with pytest.raises(ValueError, match="PUNICA_X_CUDA_ARCHS"):
            cuda_archs([])


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_cuda_kernels_compile_for_every_arch_with_ptx(tmp_path):
    """One nvcc run with the build's own flags: SASS for each default arch, PTX of the
    newest; both kernels' symbols are in the object (and, where cuobjdump is installed, the
    SASS and the PTX)."""
    out = tmp_path / "sgmv.o"
    flags = gencode_flags(CUDA_ARCHS)
    cmd = [NVCC, "-std=c++17", "-O3", *flags, "-c", str(CSRC / "sgmv_cuda.cu"), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    symbols = subprocess.run(["nm", "-C", str(out)], capture_output=True, text=True).stdout
    assert "punica_x::sgmv_shrink_cuda" in symbols
    assert "punica_x::sgmv_expand_cuda" in symbols
    cuobjdump = Path(NVCC).resolve().with_name("cuobjdump")
    if not cuobjdump.exists():  # a minimal CUDA install (this one's) has nvcc without it
        return
    for kind, arch in (("--list-elf", CUDA_ARCHS[0]), ("--list-ptx", CUDA_ARCHS[-1])):
        listing = subprocess.run([str(cuobjdump), kind, str(out)], capture_output=True, text=True)
        assert listing.returncode == 0, listing.stderr
        assert f"sm_{arch}" in listing.stdout, listing.stdout
