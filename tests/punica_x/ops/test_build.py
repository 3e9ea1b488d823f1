"""Kernel builds: a build killed mid-way, or a stale lock file, never blocks a later start;
build directories are keyed by ISA and environment; the ISA knob refuses what this CPU
cannot run. The build runs through punica_x.ops._build with a tiny pybind11 extension (a few
seconds to compile) in subprocesses, as separate starts would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from punica_x.ops import _build, isa

TOY = """
#include <pybind11/pybind11.h>
int answer() { return 42; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""

LOADER = textwrap.dedent(
    """
    import logging, sys
    from pathlib import Path
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    from punica_x.ops import _build
    _build.CSRC_ROOT = Path(sys.argv[1])
    _build.COMMON_HEADERS = ()
    _build.EXTENSIONS = {"toy_cpu": (("toy.cpp",), ())}
    print("ANSWER", _build.load_extension("toy_cpu").answer(), flush=True)
    """
)


@pytest.fixture
def toy(tmp_path, monkeypatch):
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "toy.cpp").write_text(TOY)
    monkeypatch.setenv("PUNICA_X_CACHE", str(tmp_path / "cache"))
    return src


def load_toy(src: Path, timeout: float = 240) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", LOADER, str(src)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ANSWER 42" in proc.stdout
    return proc.stdout


def build_dirs(src: Path) -> list[Path]:
    root = Path(os.environ["PUNICA_X_CACHE"]) / "torch_extensions"
    return [p for p in root.glob("punica_x_toy_cpu_*") if p.is_dir()]


def test_stale_torch_lock_never_blocks_a_start(toy):
    assert "building the toy_cpu kernels" in load_toy(toy)
    (build_dir,) = build_dirs(toy)
    (build_dir / "lock").write_text("")  # what a killed build leaves behind
    out = load_toy(toy, timeout=120)  # torch alone would wait on this file forever
    assert "left by a build that was interrupted" in out
    assert "building the toy_cpu" not in out, "an intact build is reused, not rebuilt"


def test_killing_a_start_mid_build_and_starting_again_works(toy):
    proc = subprocess.Popen(
        [sys.executable, "-c", LOADER, str(toy)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not any((d / "lock").exists() for d in build_dirs(toy)):  # the compiler is running
        assert proc.poll() is None and time.monotonic() < deadline, "the build never started"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the start and its compiler die mid-build
    proc.wait()
    assert "ANSWER" not in proc.stdout.read().decode()
    load_toy(toy)


def test_build_directories_are_keyed_by_isa_and_environment():
    key = _build.extension_name("dense_cpu", "avx2")
    assert key.startswith("punica_x_dense_cpu_avx2_")
    assert _build.extension_name("dense_cpu", "avx512") != key.replace("avx2", "avx512")
    assert _build.build_key("dense_cpu", "avx2") != _build.build_key("dense_cpu", "avx512")


def test_isa_knob(monkeypatch):
    held = []
    monkeypatch.setattr(isa, "hold_libraries", held.append)  # the process's environment stays
    monkeypatch.setenv("PUNICA_X_CPU_ISA", "native")
    assert isa.resolve() == isa.runnable_levels()[0] and held == []
    monkeypatch.setenv("PUNICA_X_CPU_ISA", "avx2")
    assert isa.resolve() == "avx2"
    assert held == ([] if isa.native() == "avx2" else ["avx2"])  # below the CPU's own: held
    assert isa.resolve("avx2") == "avx2" and len(held) <= 1  # a build's level alone holds nothing
    monkeypatch.setenv("PUNICA_X_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="PUNICA_X_CPU_ISA must be one of"):
        isa.resolve()
    assert isa.cflags("avx2")[0] == "-march=x86-64-v3"
    assert isa.cflags("avx512")[0] == "-march=x86-64-v4"


@pytest.mark.skipif("avx512" in isa.runnable_levels(), reason="this CPU runs AVX-512")
def test_a_level_this_cpu_cannot_run_is_refused_before_loading():
    with pytest.raises(_build.KernelBuildError, match="cannot run it .*lacks avx512"):
        _build.load_extension("dense_cpu", "avx512")


def test_extensions_export_only_their_module_init():
    """Each ISA build defines the same punica_x:: functions with ISA-specific layouts (an AVX2
    dense panel is 24 columns, an AVX-512 one 48); a process that loads both (tests do) must
    never bind one build's calls to the other's definitions."""
    import shutil

    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm is not installed")
    module = _build.load_extension("dense_cpu")
    symbols = subprocess.run(
        [nm, "-D", "-C", "--defined-only", module.__file__], capture_output=True, text=True
    ).stdout
    exported = [line for line in symbols.splitlines() if "punica_x::" in line]
    assert not exported, exported[:5]
    assert "PyInit_" in symbols


@pytest.mark.parametrize("kind", sorted(_build.EXTENSIONS))
def test_every_header_a_build_includes_is_in_its_build_key(kind):
    """A header missing from an extension's list leaves its build key unchanged when the
    header changes: a warm cache would keep running the old code (sgmv_cuda compiled
    sgmv_cpu.cpp without expand_dot.h in its key)."""
    import re

    sources, headers = _build.EXTENSIONS[kind]
    keyed = set(headers) | set(_build.COMMON_HEADERS)
    todo, seen = list(sources), set()
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        text = (_build.CSRC_ROOT / rel).read_text()
        for inc in re.findall(r'^#include "([^"]+)"', text, re.MULTILINE):
            todo.append(os.path.normpath(os.path.join(os.path.dirname(rel), inc)))
    assert seen - set(sources) <= keyed, sorted(seen - set(sources) - keyed)


def test_a_held_level_holds_torch_and_is_not_bf16_native(monkeypatch):
    """PUNICA_X_CPU_ISA=avx2 on a bigger CPU stands for an AVX2 machine: torch's ATen, oneDNN
    and MKL are held to AVX2 through their variables (a user's own setting stays), and
    bfloat16 is not native there."""
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.setenv(name, "x")  # restored (or removed) after the test
        monkeypatch.delenv(name)
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "SSE4_2")
    isa.hold_libraries.__wrapped__("avx2")
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert os.environ["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"
    monkeypatch.setattr(isa, "hold_libraries", lambda level: None)
    monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset(isa._REQUIRED["avx512_bf16"]))
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("PUNICA_X_CPU_ISA", "native")
    assert isa.native_bf16()
    for held in ("avx2", "avx512"):
        monkeypatch.setenv("PUNICA_X_CPU_ISA", held)
        assert not isa.native_bf16()
