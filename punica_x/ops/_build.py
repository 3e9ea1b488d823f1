"""Builds the C++/CUDA extensions under csrc/ once per build key and caches them.

Instruction set ($PUNICA_X_CPU_ISA, see punica_x.ops.isa): the CPU kernels size their
register tiles for the ISA they are compiled for, so one source tree gives an AVX-512 and
an AVX2 build; `native` (the default) takes the best level this CPU runs. An AVX-512
machine can build, test and benchmark the AVX2 path with PUNICA_X_CPU_ISA=avx2.

Build directory: <cache>/torch_extensions/punica_x_<kind>_<isa>_<key>, the key hashing the
sources, the compiler flags, torch's version and install path, the Python executable and
this CPU's model and flags: two virtual environments or two machines sharing one cache never
rebuild each other's kernels, and none loads a binary built for another CPU.

Concurrency and interrupted builds: a build holds an fcntl lock on <build dir>.lock, which the
kernel releases when its holder dies. torch's own lock file (`lock` inside the build
directory) outlives a killed build and makes every later start wait forever; while holding
our lock no other punica-x process can be building there, so such a file is stale and is
removed (with a warning). Build progress goes to the `punica_x.build` logger.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from punica_x.env import cache_dir
from punica_x.ops import isa as isa_mod
from punica_x.ops.isa import KernelBuildError

log = logging.getLogger("punica_x.build")


def _csrc_root() -> Path:
    """The kernel sources: csrc/ beside the package in a checkout, else punica_x/csrc where
    an installed wheel carries them (setup.py copies csrc/ there)."""
    here = Path(__file__).resolve()
    checkout, installed = here.parents[2] / "csrc", here.parents[1] / "csrc"
    return checkout if checkout.is_dir() or not installed.is_dir() else installed


CSRC_ROOT = _csrc_root()
CSRC = CSRC_ROOT / "sgmv"
# compiled for when no GPU is visible at build time (or PUNICA_X_CUDA_ARCHS says otherwise)
CUDA_ARCHS = ("80", "90")
COMMON_HEADERS = ("common/simd.h", "common/parallel.h", "common/prefetch.h", "common/dispatch.h")
EMULATION_HEADER = "common/emulated_isa.h"  # the emulated levels' (isa.EMULATED) only
# kind: (sources, headers), paths relative to csrc/
EXTENSIONS = {
    "sgmv_cpu": (
        ("sgmv/bindings.cpp", "sgmv/sgmv_cpu.cpp"),
        ("sgmv/sgmv.h", "sgmv/expand_dot.h", "sgmv/amx.h", "sgmv/amx_machine.h"),
    ),
    "sgmv_cuda": (
        ("sgmv/bindings.cpp", "sgmv/sgmv_cpu.cpp", "sgmv/sgmv_cuda.cu"),
        ("sgmv/sgmv.h", "sgmv/expand_dot.h", "sgmv/amx.h", "sgmv/amx_machine.h"),
    ),
    "attention_cpu": (
        ("attention/bindings.cpp", "attention/paged_attention_cpu.cpp", "layers/fused_cpu.cpp"),
        ("attention/paged_attention.h", "layers/fused.h"),
    ),
    "dense_cpu": (("dense/bindings.cpp", "dense/dense_cpu.cpp"), ("dense/dense.h",)),
    "layers_cpu": (("layers/bindings.cpp", "layers/fused_cpu.cpp"), ("layers/fused.h",)),
    "quant_cpu": (
        ("quant/bindings.cpp", "quant/quant_cpu.cpp", "quant/quant_xq_cpu.cpp"),
        ("quant/quant.h",),
    ),
}
CPU_KINDS = ("sgmv_cpu", "attention_cpu", "dense_cpu", "layers_cpu", "quant_cpu")


def cuda_archs(capabilities: list[tuple[int, int]] | None = None) -> tuple[str, ...]:
    """The SM architectures to compile the CUDA kernels for: $PUNICA_X_CUDA_ARCHS (e.g.
    "80,90"), else the visible GPUs' (capabilities: [(major, minor)], default torch's), else
    CUDA_ARCHS. ValueError for a malformed list."""
    env = os.environ.get("PUNICA_X_CUDA_ARCHS", "").strip()
    if env:
        archs = [a.strip() for a in env.split(",")]
        if not all(a.isdigit() and 2 <= len(a) <= 3 for a in archs):
            raise ValueError(f"PUNICA_X_CUDA_ARCHS must list SM numbers like 80,90, got {env!r}")
        return tuple(sorted(set(archs), key=int))
    if capabilities is None:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        capabilities = [torch.cuda.get_device_capability(i) for i in range(n)]
    found = {f"{major}{minor}" for major, minor in capabilities}
    return tuple(sorted(found, key=int)) or CUDA_ARCHS


def gencode_flags(archs: tuple[str, ...]) -> list[str]:
    """nvcc flags: SASS for each architecture, and PTX of the newest, so a GPU newer than
    every one of them still runs the kernels (the driver compiles the PTX at load)."""
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    newest = max(archs, key=int)
    return [*flags, f"-gencode=arch=compute_{newest},code=compute_{newest}"]


def build_key(kind: str, isa: str) -> str:
    """Hash of everything that makes a binary differ: sources, flags, torch, Python, CPU (and
    an emulated level's emulation: its header and SIMDe's version)."""
    names, headers = EXTENSIONS[kind]
    h = hashlib.sha256()
    emulated = (EMULATION_HEADER,) if isa in isa_mod.EMULATED else ()
    for rel in sorted(names + headers + COMMON_HEADERS + emulated):
        h.update(rel.encode())
        h.update((CSRC_ROOT / rel).read_bytes())
    simde = Path(isa_mod.simde_root() or "/nonexistent") / "simde" / "simde-common.h"
    if emulated and simde.is_file():
        h.update(simde.read_bytes())
    for part in (
        torch.__version__,
        str(Path(torch.__file__).resolve().parent),
        str(Path(sys.prefix).resolve()),
        isa,
        " ".join(isa_mod.cflags(isa)),
        isa_mod.cpu_model(),
        " ".join(sorted(isa_mod.cpu_flags())),
        str(kind.endswith("_cuda")),
        ",".join(cuda_archs()) if kind.endswith("_cuda") else "",
    ):
        h.update(part.encode())
    return h.hexdigest()[:16]


def extension_name(kind: str, isa: str) -> str:
    return f"punica_x_{kind}_{isa}_{build_key(kind, isa)}"


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


def load_extension(kind: str, isa: str | None = None) -> ModuleType:
    """Compile (once per build key) and import the extension `kind` of EXTENSIONS for `isa`
    (None: $PUNICA_X_CPU_ISA, default native). Raises KernelBuildError when it cannot be built
    or this CPU cannot run that instruction set."""
    return _load(kind, isa_mod.resolve(isa))


@cache
def _load(kind: str, isa: str) -> ModuleType:
    isa_mod.check_runnable(isa)
    names, _ = EXTENSIONS[kind]
    return _build(kind, isa, names, with_cuda=kind.endswith("_cuda"))


def is_built(kind: str, isa: str | None = None) -> bool:
    """Whether the extension's binary is already in the cache (a start needs no compiler)."""
    isa = isa_mod.resolve(isa)
    name = extension_name(kind, isa)
    return (cache_dir("torch_extensions") / name / f"{name}.so").exists()


@contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Exclusive per build directory; released by the OS if this process dies."""
    with open(build_dir.with_name(build_dir.name + ".lock"), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process that is building %s", build_dir.name)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build that was interrupted", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(kind: str, isa: str, names, with_cuda: bool) -> ModuleType:
    from torch.utils import cpp_extension

    if not CSRC_ROOT.is_dir():
        raise KernelBuildError(f"kernel sources not found at {CSRC_ROOT} (punica-x needs csrc/)")
    sources = [CSRC_ROOT / n for n in names]
    name = extension_name(kind, isa)
    build_dir = cache_dir("torch_extensions", name)
    # Hidden visibility (pybind11's advice): every ISA build defines the same punica_x::
    # functions, and a process that loads two builds (tests do) must never bind one build's
    # calls to the other's definitions; only PyInit_* is exported.
    cflags = ["-O3", *isa_mod.cflags(isa), "-fopenmp", "-fvisibility=hidden"]
    if isa in isa_mod.EMULATED:  # first in every translation unit (emulated_isa.h says why)
        cflags += ["-include", str(CSRC_ROOT / EMULATION_HEADER)]
    cuda_flags = ["-O3", "-Xcompiler", "-fvisibility=hidden"]
    if with_cuda:
        cflags.append("-DPUNICA_X_WITH_CUDA")
        cuda_flags += ["-DPUNICA_X_WITH_CUDA"]
        cuda_flags += gencode_flags(cuda_archs())
    _ensure_ninja_on_path()
    with _build_lock(build_dir):
        fresh = not (build_dir / f"{name}.so").exists()
        if fresh:
            log.warning(
                "building the %s kernels for %s into %s (once per torch/CPU/ISA; ~40 s on 2 cores)",
                kind,
                isa,
                build_dir,
            )
        started = time.perf_counter()
        try:
            module = cpp_extension.load(
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
                "Set PUNICA_X_SGMV_BACKEND=torch_ref, PUNICA_X_ATTENTION_BACKEND=torch, "
                "PUNICA_X_DENSE_BACKEND=torch and PUNICA_X_FUSED_BACKEND=torch to run the "
                "PyTorch paths instead."
            ) from exc
        if fresh:
            log.warning("built %s in %.0f s", kind, time.perf_counter() - started)
    return module
