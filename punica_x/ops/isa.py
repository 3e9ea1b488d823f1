"""Which instruction set the CPU kernels are compiled for ($PUNICA_X_CPU_ISA).

Levels (x86-64 micro-architecture levels, as GCC names them):
* ``avx512_bf16``: x86-64-v4 plus AVX512-BF16 and AVX512-VNNI (every CPU with the first has
  the second: Cooper Lake, Sapphire Rapids, Zen 4): the avx512 kernels, with bfloat16 products
  through the dot-product instruction (vdpbf16ps: 32 bf16 multiply-adds per instruction, twice
  an fp32 FMA's) instead of widening every bf16 value to float32 first, and byte dot products
  (vpdpbusd) for the quantized kernels' 8-bit activations
* ``avx512``: x86-64-v4 (AVX-512 F/BW/CD/DQ/VL): 16-float vectors, 32 registers
* ``avx2``:   x86-64-v3 (AVX2, FMA, BMI1/2, F16C, MOVBE): 8-float vectors, 16 registers
* ``generic``: any other CPU (ARM, older x86): built with -march/-mcpu=native on request, but
  the PyTorch paths are the default there (the kernels are tuned for the levels above)
``native`` (the default) is the best level this CPU runs (an AVX512-BF16 machine's native and
avx512_bf16 builds are one build). A level this CPU cannot run is refused before anything loads.

For tests: ``avx512_emulated`` and ``avx512_bf16_emulated`` compile those levels' code paths
on an AVX2 CPU with the AVX-512 intrinsics emulated in software (csrc/common/emulated_isa.h,
SIMDe's headers from Debian's libsimde-dev): many times slower, never chosen by ``native``,
offered where this CPU lacks the level and the headers are installed (emulated_levels).
"""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path

from punica_x.env import CPU_ISA

LEVELS = ("avx512_bf16", "avx512", "avx2", "generic")
CHOICES = ("native", "avx512_bf16", "avx512", "avx2")
_AVX512 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma"}
_REQUIRED = {
    "avx512_bf16": _AVX512 | {"avx512_bf16", "avx512_vnni"},
    "avx512": _AVX512,
    "avx2": {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"},
}
_MARCH = {"avx512_bf16": "x86-64-v4", "avx512": "x86-64-v4", "avx2": "x86-64-v3"}
EMULATED = {"avx512_emulated": ("avx512", 1), "avx512_bf16_emulated": ("avx512_bf16", 2)}
SIMDE_HEADER = "simde/x86/avx512.h"
SIMDE_ROOTS = ("/usr/include", "/usr/local/include")


@cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(CPU model name, feature flags) from /proc/cpuinfo (x86 `flags`, ARM `Features`)."""
    model, flags = "", frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and not model:
                model = value
            elif key in ("flags", "Features") and not flags:
                flags = frozenset(value.split())
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def cpu_model() -> str:
    return _cpuinfo()[0]


def cpu_flags() -> frozenset[str]:
    return _cpuinfo()[1]


def runnable_levels() -> tuple[str, ...]:
    """The levels this CPU can run, best first (always ends with generic)."""
    flags = cpu_flags()
    x86 = platform.machine() in ("x86_64", "AMD64")
    return tuple(lvl for lvl in LEVELS if lvl == "generic" or (x86 and _REQUIRED[lvl] <= flags))


def native() -> str:
    return runnable_levels()[0]


def simde_root() -> str | None:
    """The include folder holding SIMDe's AVX-512 header, None where it is not installed."""
    return next((r for r in SIMDE_ROOTS if (Path(r) / SIMDE_HEADER).is_file()), None)


def emulated_levels() -> tuple[str, ...]:
    """The emulated levels offered here: those of a level this CPU cannot run, on an AVX2 CPU
    with SIMDe's headers installed."""
    runs = runnable_levels()
    if "avx2" not in runs or simde_root() is None:
        return ()
    return tuple(name for name, (level, _) in EMULATED.items() if level not in runs)


def resolve(isa: str | None = None) -> str:
    """`isa`, else $PUNICA_X_CPU_ISA, else native -> a concrete level. The process's level
    (no `isa`) below this CPU's own also holds torch's libraries to it (hold_libraries)."""
    choice = (isa or CPU_ISA.get() or "native").strip().lower()
    if choice not in (*CHOICES, "generic", *EMULATED):
        named = ", ".join((*CHOICES, "generic", *EMULATED))
        raise ValueError(f"PUNICA_X_CPU_ISA must be one of {named}; got {choice!r}")
    level = native() if choice == "native" else choice
    if isa is None and level in _HELD and level != native():
        hold_libraries(level)
    return level


# What holds torch's own CPU code to a level: ATen's vectorized kernels, oneDNN (matmuls,
# bf16 among them) and MKL (float32 GEMMs), each read once, at its first use in the process.
_HELD = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
}  # fmt: skip
LIBRARY_ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


@cache
def hold_libraries(level: str) -> None:
    """$PUNICA_X_CPU_ISA=avx2 (or avx512) on a CPU with more makes the process that machine:
    our kernels are built for the level, and torch's ATen, oneDNN and MKL are held to it as
    well (their environment variables, where not set already), and bfloat16 is not native
    (native_bf16). Without this, an AVX2 build on an AVX512-BF16 CPU measured our AVX2
    kernels beside oneDNN's AVX512-BF16 matmuls, a machine that does not exist (the dense
    backends' timing then chose oneDNN for every bfloat16 projection). Takes effect for each
    library on its first use, so it is called on the first resolve() of the process's level,
    before any kernel loads."""
    for name, value in _HELD[level].items():
        os.environ.setdefault(name, value)


class KernelBuildError(RuntimeError):
    """An extension could not be compiled; the message carries the compiler output."""


def check_runnable(isa: str) -> None:
    if isa in EMULATED:
        if isa not in emulated_levels():
            raise KernelBuildError(
                f"PUNICA_X_CPU_ISA={isa}: emulated builds need an AVX2 CPU without "
                f"{EMULATED[isa][0]} and SIMDe's headers ({SIMDE_HEADER} under one of "
                f"{', '.join(SIMDE_ROOTS)}: Debian's libsimde-dev)"
            )
        return
    if isa not in runnable_levels():
        missing = sorted(_REQUIRED.get(isa, set()) - cpu_flags())
        raise KernelBuildError(
            f"PUNICA_X_CPU_ISA={isa}: this CPU ({cpu_model()}) cannot run it "
            f"(lacks {', '.join(missing) or 'x86-64'}); it runs {', '.join(runnable_levels())}"
        )


def cflags(isa: str) -> list[str]:
    """Compiler flags of a level; -mtune=native only schedules instructions for this CPU. An
    emulated level is the avx2 target with csrc/common/emulated_isa.h's switch (the build
    adds that header to every translation unit), at -O1 (after the build's -O3: its code is
    for tests, where the compile's time counts more than the emulation's speed)."""
    if isa in EMULATED:
        return [
            "-O1",
            "-march=x86-64-v3",
            "-mtune=native",
            f"-DPUNICA_X_EMULATE_AVX512={EMULATED[isa][1]}",
        ]
    if isa in _MARCH:
        flags = [f"-march={_MARCH[isa]}", "-mtune=native"]
        if isa.startswith("avx512"):
            flags.append("-mprefer-vector-width=512")
        return flags + (["-mavx512bf16", "-mavx512vnni"] if isa == "avx512_bf16" else [])
    return ["-mcpu=native"] if platform.machine() in ("aarch64", "arm64") else ["-march=native"]


def tuned() -> bool:
    """Whether the hand-written CPU kernels are tuned for the native level (x86 AVX2/AVX-512;
    an emulated level's code is theirs, if slow)."""
    return resolve() in _MARCH or resolve() in EMULATED


def native_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX-BF16): where
    dtype=auto serves bfloat16 and oneDNN's bf16 matmul is fast. A process held to avx2 or
    avx512 ($PUNICA_X_CPU_ISA, see hold_libraries) stands for a CPU without it."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"}) and resolve() not in _HELD
