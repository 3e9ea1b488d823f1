"""The CPU kernels compile for every instruction-set level, including those this CPU cannot
run (an AVX2 machine still checks that the AVX-512 tiles fit their registers: the kernels
static_assert it). Levels this CPU runs are built, loaded and tested against the references
in tests/punica_x (the `cpu_isa` fixture)."""

import os
import shutil
import subprocess

import pytest

from punica_x.ops import isa as isa_mod
from punica_x.ops._build import CSRC_ROOT

KERNELS = (
    "sgmv/sgmv_cpu.cpp",
    "dense/dense_cpu.cpp",
    "attention/paged_attention_cpu.cpp",
    "layers/fused_cpu.cpp",
    "quant/quant_cpu.cpp",
)
CXX = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
LEVELS = ("avx2", "avx512", "avx512_bf16")
NOT_RUNNABLE = [lvl for lvl in LEVELS if lvl not in isa_mod.runnable_levels()]


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
@pytest.mark.skipif(not NOT_RUNNABLE, reason="this CPU runs every level: they are tested for real")
@pytest.mark.parametrize("isa", NOT_RUNNABLE or ["none"])
def test_kernels_compile_for_levels_this_cpu_cannot_run(tmp_path, isa):
    from torch.utils.cpp_extension import include_paths

    includes = [f"-isystem{p}" for p in include_paths()]
    flags = ["-std=c++20", "-O2", *isa_mod.cflags(isa), "-fopenmp"]
    for source in KERNELS:
        out = tmp_path / (source.replace("/", "_") + ".o")
        cmd = [CXX, *flags, *includes, "-c", str(CSRC_ROOT / source), "-o", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{source} for {isa}:\n{proc.stderr[-3000:]}"
        symbols = subprocess.run(["nm", "-C", str(out)], capture_output=True, text=True).stdout
        assert "punica_x::" in symbols, source
