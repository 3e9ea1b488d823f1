"""Typed registry of the environment variables punica-x reads (one place, read on use)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str

    def get(self) -> str:
        return os.environ.get(self.name, self.default)


CACHE_DIR = EnvVar(
    "PUNICA_X_CACHE",
    str(Path.home() / ".cache" / "punica-x"),
    "where converted models and compiled kernels are cached",
)
SGMV_BACKEND = EnvVar(
    "PUNICA_X_SGMV_BACKEND",
    "",
    "force an SGMV backend: cpu, cuda or torch_ref (default: by device)",
)


def cache_dir(*parts: str) -> Path:
    """A directory under the punica-x cache, created on first use."""
    path = Path(CACHE_DIR.get()).expanduser().joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


OVERLAP = EnvVar(
    "PUNICA_X_OVERLAP",
    "",
    "what EngineConfig.overlap auto means: on or off (default: on with the simulated device "
    "only); the test suite runs with it on to check overlapped steps everywhere",
)
ATTENTION_BACKEND = EnvVar(
    "PUNICA_X_ATTENTION_BACKEND", "", "force an attention backend: cpu, torch or flashinfer"
)
DENSE_BACKEND = EnvVar(
    "PUNICA_X_DENSE_BACKEND", "", "force the backbone's dense backend: cpu (packed) or torch"
)
FUSED_BACKEND = EnvVar(
    "PUNICA_X_FUSED_BACKEND", "", "force the fused norm/RoPE/SiLU backend: cpu or torch"
)
CPU_ISA = EnvVar(
    "PUNICA_X_CPU_ISA",
    "native",
    "instruction set the CPU kernels are built for: native (best this CPU runs), avx2, avx512, "
    "avx512_bf16",
)
SGMV_AMX = EnvVar(
    "PUNICA_X_SGMV_AMX",
    "auto",
    "AMX-BF16 tiles for bfloat16 LoRA segments of 8 rows or more (csrc/sgmv/amx.h): auto (on "
    "where the CPU and OS give them), 1 (on; refused at start where there are none) or 0 (off)",
)
AUTOTUNE = EnvVar(
    "PUNICA_X_AUTOTUNE",
    "1",
    "0 turns off the first-load timing of backends (then: compiled kernels where the CPU is "
    "AVX2/AVX-512, PyTorch elsewhere)",
)
QUIET_WAIT = EnvVar(
    "PUNICA_X_QUIET_WAIT",
    "5",
    "seconds a first start waits for other processes to leave the CPUs before it times the "
    "batch-invariant mode's cost (--batch-invariant auto; a figure taken under load is kept "
    "as provisional); the test suite sets 0",
)
