"""Builds the SGMV extension from csrc/sgmv on first use and caches it.

The build is keyed by the sources, the torch version and this CPU's instruction-set flags
(the CPU kernel is compiled with -march=native), so a cache shared between machines never
loads a binary built for another CPU.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from punica_x.env import cache_dir

CSRC = Path(__file__).resolve().parents[2] / "csrc" / "sgmv"
CPU_SOURCES = ("bindings.cpp", "sgmv_cpu.cpp")
CUDA_SOURCES = ("sgmv_cuda.cu",)
HEADERS = ("sgmv.h",)
CUDA_ARCHS = ("80", "90")


class KernelBuildError(RuntimeError):
    """The SGMV extension could not be compiled; the message carries the compiler output."""


def _cpu_fingerprint() -> str:
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags


def _build_key(sources: list[Path], with_cuda: bool) -> str:
    h = hashlib.sha256()
    for path in sorted(sources):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(torch.__version__.encode())
    h.update(_cpu_fingerprint().encode())
    h.update(str(with_cuda).encode())
    return h.hexdigest()[:16]


def _ensure_ninja_on_path() -> None:
    # torch builds with the `ninja` executable; a venv's bin dir is not on PATH unless activated.
    candidates = [Path(sys.executable).parent]
    try:
        import ninja

        candidates.append(Path(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    path = os.environ.get("PATH", "")
    for directory in candidates:
        if (directory / "ninja").exists() and str(directory) not in path.split(os.pathsep):
            path = f"{directory}{os.pathsep}{path}"
    os.environ["PATH"] = path


@cache
def load_sgmv_extension(with_cuda: bool) -> ModuleType:
    """Compile (once per key) and import the SGMV extension; CUDA kernels when `with_cuda`."""
    from torch.utils import cpp_extension

    if not CSRC.is_dir():
        raise KernelBuildError(f"SGMV sources not found at {CSRC} (punica-x needs its csrc/ tree)")
    names = CPU_SOURCES + (CUDA_SOURCES if with_cuda else ())
    sources = [CSRC / n for n in names]
    key = _build_key(sources + [CSRC / h for h in HEADERS], with_cuda)
    name = f"punica_x_sgmv_{'cuda' if with_cuda else 'cpu'}_{key}"
    build_dir = cache_dir("torch_extensions", name)
    cflags = ["-O3", "-march=native", "-fopenmp"]
    cuda_flags = ["-O3"]
    if with_cuda:
        cflags.append("-DPUNICA_X_WITH_CUDA")
        cuda_flags += ["-DPUNICA_X_WITH_CUDA"]
        cuda_flags += [f"-gencode=arch=compute_{a},code=sm_{a}" for a in CUDA_ARCHS]
    _ensure_ninja_on_path()
    try:
        return cpp_extension.load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=cflags,
            extra_cuda_cflags=cuda_flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            with_cuda=with_cuda,
            verbose=False,
        )
    except Exception as exc:  # the compiler's output is in the message
        raise KernelBuildError(
            f"building the SGMV extension {name} failed: {exc}\n"
            "Set PUNICA_X_SGMV_BACKEND=torch_ref to run the (slow) pure-PyTorch reference instead."
        ) from exc
