"""`pip install .` from an sdist: the kernel sources travel with the package (MANIFEST.in into
the sdist, setup.py into the wheel as punica_x/csrc), byte for byte, and the installed
package, away from any checkout, imports and finds them. Its build key hashes the sources,
so it names the binary this suite builds from the checkout and tests (loading it from the
installed copy would recompile it: torch's build records the source paths; a compile from
an installed copy in an empty cache was measured, 40 s on 2 cores, and is left out of the
suite for its time)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNEL_FILES = sorted(
    p.relative_to(ROOT / "csrc").as_posix()
    for p in (ROOT / "csrc").rglob("*")
    if p.suffix in (".cpp", ".h", ".cu")
)


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sdist")
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(out)!r}))"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out / proc.stdout.strip().splitlines()[-1]


def test_the_sdist_carries_the_kernel_sources(sdist):
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {f"csrc/{f}" for f in KERNEL_FILES} <= names
    assert {"setup.py", "MANIFEST.in", "pyproject.toml"} <= names


def test_an_install_from_the_sdist_imports_and_finds_its_kernels(sdist, tmp_path):
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q"]
    proc = subprocess.run(
        [*pip, "--target", str(target), str(sdist)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    csrc = target / "punica_x" / "csrc"
    installed = {p.relative_to(csrc).as_posix() for p in csrc.rglob("*") if p.is_file()}
    assert installed == set(KERNEL_FILES)
    for name in KERNEL_FILES:
        assert (csrc / name).read_bytes() == (ROOT / "csrc" / name).read_bytes(), name
    code = (
        "import punica_x, frontend.cli, scheduler.cluster\n"
        "from punica_x.ops import _build\n"
        "print(punica_x.__file__)\n"
        "print(_build.CSRC_ROOT)\n"
        "isa = _build.isa_mod.resolve(None)\n"
        "print(_build.is_built('layers_cpu', isa))\n"
        "print(_build.build_key('layers_cpu', isa))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    module_file, found, built, key = proc.stdout.split()
    assert Path(module_file).is_relative_to(target)  # the installed copy, not the checkout
    assert Path(found) == csrc
    from punica_x.ops import _build

    isa = _build.isa_mod.resolve(None)
    assert key == _build.build_key("layers_cpu", isa)
    assert built == str(_build.is_built("layers_cpu", isa))
