"""setuptools entry point beside pyproject.toml (which holds the metadata): it only makes a
wheel carry the kernel sources. csrc/ stays at the top of the checkout (the lowest layer);
build_py copies it to punica_x/csrc in the wheel, where punica_x/ops/_build.py looks for it
when no checkout is around, so `pip install .` (or from an sdist: MANIFEST.in grafts
csrc/) gives a package whose kernels build on first use, as in a checkout."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

KERNEL_SOURCES = ("*.cpp", "*.h", "*.cu", "*.cuh")


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        src = Path(__file__).resolve().parent / "csrc"
        dst = Path(self.build_lib) / "punica_x" / "csrc"
        for path in src.rglob("*"):
            if path.is_file() and any(path.match(p) for p in KERNEL_SOURCES):
                target = dst / path.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)


setup(cmdclass={"build_py": BuildPyWithKernels})
