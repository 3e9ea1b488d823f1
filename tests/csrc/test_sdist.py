"""`pip install .` from an sdist: the kernel sources travel with the package (MANIFEST.in into
the sdist, setup.py into the wheel as punica_x/csrc), and the installed package, away from
any checkout and with an empty cache, finds them and builds a kernel."""

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


def test_an_install_from_the_sdist_builds_a_kernel(sdist, tmp_path):
    target, cache = tmp_path / "site", tmp_path / "cache"
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q"]
    proc = subprocess.run(
        [*pip, "--target", str(target), str(sdist)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    installed = {
        p.relative_to(target / "punica_x" / "csrc").as_posix()
        for p in (target / "punica_x" / "csrc").rglob("*")
        if p.is_file()
    }
    assert installed == set(KERNEL_FILES)
    code = (
        "import punica_x, frontend.cli, scheduler.cluster\n"
        "from punica_x.ops import _build\n"
        "print(punica_x.__file__)\n"
        "print(_build.CSRC_ROOT)\n"
        "print(_build.load_extension('layers_cpu').isa())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target), "PUNICA_X_CACHE": str(cache)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    module_file, csrc, isa = proc.stdout.split()
    assert Path(module_file).is_relative_to(target)  # the installed copy, not the checkout
    assert Path(csrc) == target / "punica_x" / "csrc"
    assert isa and list(cache.glob("torch_extensions/punica_x_layers_cpu_*/*.so"))
