"""Builds the C++/CUDA extensions (csrc/sgmv, csrc/attention) on first use and caches them.

The build is keyed by the sources, the torch version and this CPU's instruction-set flags
(CPU kernels are compiled with -march=native), so a cache shared between machines never
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

CSRC_ROOT = Path(__file__).resolve().parents[2] / "csrc"
CSRC = CSRC_ROOT / "sgmv"
CUDA_ARCHS = ("80", "90")
COMMON_HEADERS = ("common/simd.h", "common/parallel.h")
# kind: (sources, headers), paths relative to csrc/
EXTENSIONS = {
    "sgmv_cpu": (("sgmv/bindings.cpp", "sgmv/sgmv_cpu.cpp"), ("sgmv/sgmv.h",)),
    "sgmv_cuda": (
        ("sgmv/bindings.cpp", "sgmv/sgmv_cpu.cpp", "sgmv/sgmv_cuda.cu"),
        ("sgmv/sgmv.h",),
    ),
    "attention_cpu": (
        ("attention/bindings.cpp", "attention/paged_attention_cpu.cpp"),
        ("attention/paged_attention.h",),
    ),
    "dense_cpu": (("dense/bindings.cpp", "dense/dense_cpu.cpp"), ("dense/dense.h",)),
    "layers_cpu": (("layers/bindings.cpp", "layers/fused_cpu.cpp"), ("layers/fused.h",)),
}


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
        h.update(str(path.relative_to(CSRC_ROOT)).encode())
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


def load_sgmv_extension(with_cuda: bool) -> ModuleType:
    """The SGMV extension; with the CUDA kernels when `with_cuda`."""
    return load_extension("sgmv_cuda" if with_cuda else "sgmv_cpu")


def load_attention_extension() -> ModuleType:
    return load_extension("attention_cpu")


def load_dense_extension() -> ModuleType:
    return load_extension("dense_cpu")


@cache
def load_extension(kind: str) -> ModuleType:
    """Compile (once per build key) and import the extension `kind` of EXTENSIONS."""
    names, headers = EXTENSIONS[kind]
    return _build(kind, names, headers + COMMON_HEADERS, with_cuda=kind.endswith("_cuda"))


def _build(kind: str, names, headers, with_cuda: bool) -> ModuleType:
    from torch.utils import cpp_extension

    if not CSRC_ROOT.is_dir():
        raise KernelBuildError(f"kernel sources not found at {CSRC_ROOT} (punica-x needs csrc/)")
    sources = [CSRC_ROOT / n for n in names]
    key = _build_key(sources + [CSRC_ROOT / h for h in headers], with_cuda)
    name = f"punica_x_{kind}_{key}"
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
            f"building the {kind} extension {name} failed: {exc}\n"
            "Set PUNICA_X_SGMV_BACKEND=torch_ref / PUNICA_X_ATTENTION_BACKEND=torch to run the "
            "(slow) pure-PyTorch references instead."
        ) from exc
