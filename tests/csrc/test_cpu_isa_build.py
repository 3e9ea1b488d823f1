"""The CPU kernels compile for every instruction-set level, including those this CPU cannot
run (an AVX2 machine still checks that the AVX-512 tiles fit their registers: the kernels
static_assert it). Levels this CPU runs are built, loaded and tested against the references
in tests/punica_x (the `cpu_isa` fixture)."""

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from punica_x.ops import isa as isa_mod
from punica_x.ops._build import CSRC_ROOT

KERNELS = (
    "sgmv/sgmv_cpu.cpp",
    "dense/dense_cpu.cpp",
    "attention/paged_attention_cpu.cpp",
    "layers/fused_cpu.cpp",
    "quant/quant_cpu.cpp",
    "quant/quant_xq_cpu.cpp",
)
CXX = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
LEVELS = ("avx2", "avx512", "avx512_bf16")
NOT_RUNNABLE = [lvl for lvl in LEVELS if lvl not in isa_mod.runnable_levels()]


def compile_each(flags: list[str], folder, what: str) -> list[tuple[str, object]]:
    """Every source of KERNELS compiled (-c) with `flags` into `folder`, as many at once as
    this machine has cores (each compiler is one thread); (source, object) of each, or the
    failure of the first that did not compile."""
    outs = [folder / (source.replace("/", "_") + ".o") for source in KERNELS]

    def run(source, out):
        cmd = [CXX, *flags, "-c", str(CSRC_ROOT / source), "-o", str(out)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        procs = list(pool.map(run, KERNELS, outs))
    for source, proc in zip(KERNELS, procs, strict=True):
        assert proc.returncode == 0, f"{source} {what}:\n{proc.stderr[-3000:]}"
    return list(zip(KERNELS, outs, strict=True))


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
@pytest.mark.skipif(not NOT_RUNNABLE, reason="this CPU runs every level: they are tested for real")
@pytest.mark.parametrize("isa", NOT_RUNNABLE or ["none"])
def test_kernels_compile_for_levels_this_cpu_cannot_run(tmp_path, isa):
    from torch.utils.cpp_extension import include_paths

    includes = [f"-isystem{p}" for p in include_paths()]
    flags = ["-std=c++20", "-O2", *isa_mod.cflags(isa), "-fopenmp", *includes]
    for source, out in compile_each(flags, tmp_path, f"for {isa}"):
        symbols = subprocess.run(["nm", "-C", str(out)], capture_output=True, text=True).stdout
        assert "punica_x::" in symbols, source


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
@pytest.mark.parametrize("isa", isa_mod.EMULATED)
def test_kernels_compile_with_avx512_emulated(tmp_path, isa):
    """Every kernel compiles and links its intrinsics against the emulation (an intrinsic
    SIMDe lacks fails here, where GCC cannot inline its AVX-512 version: emulated_isa.h
    must provide it); make test-long then runs the kernels' tests on the emulated builds."""
    from torch.utils.cpp_extension import include_paths

    if isa not in isa_mod.emulated_levels():
        pytest.skip(f"{isa}: this CPU runs the level itself, or SIMDe's headers are missing")
    includes = [f"-isystem{p}" for p in include_paths()]
    header = str(CSRC_ROOT / "common" / "emulated_isa.h")
    flags = ["-std=c++20", *isa_mod.cflags(isa), "-include", header, "-fopenmp", *includes]
    compile_each(flags, tmp_path, "emulated")


@pytest.mark.parametrize(
    ("runs", "simde", "offered"),
    [
        (("avx2", "generic"), "/usr/include", ("avx512_emulated", "avx512_bf16_emulated")),
        (("avx512", "avx2", "generic"), "/usr/include", ("avx512_bf16_emulated",)),
        (("avx512_bf16", "avx512", "avx2", "generic"), "/usr/include", ()),
        (("avx2", "generic"), None, ()),  # no SIMDe headers
        (("generic",), "/usr/include", ()),  # no AVX2 to emulate on
    ],
)
def test_emulated_levels_are_offered_only_where_they_can_run(monkeypatch, runs, simde, offered):
    monkeypatch.setattr(isa_mod, "runnable_levels", lambda: runs)
    monkeypatch.setattr(isa_mod, "simde_root", lambda: simde)
    assert isa_mod.emulated_levels() == offered
    assert isa_mod.native() == runs[0]  # never an emulated level
    for level in isa_mod.EMULATED:
        assert isa_mod.resolve(level) == level
        if level not in offered:
            with pytest.raises(isa_mod.KernelBuildError, match="libsimde-dev"):
                isa_mod.check_runnable(level)
        else:
            isa_mod.check_runnable(level)


def test_an_emulated_level_builds_for_avx2_with_its_switch():
    flags = isa_mod.cflags("avx512_bf16_emulated")
    assert "-march=x86-64-v3" in flags and "-DPUNICA_X_EMULATE_AVX512=2" in flags
    assert "-DPUNICA_X_EMULATE_AVX512=1" in isa_mod.cflags("avx512_emulated")
    assert flags[0] == "-O1"  # after the build's -O3
    with pytest.raises(ValueError, match="PUNICA_X_CPU_ISA must be one of .*avx512_emulated"):
        isa_mod.resolve("avx512_bf16_emulated_not")
