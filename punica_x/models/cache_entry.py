"""A directory of the model cache built atomically: written in a temporary sibling, then
renamed into place, so a reader never sees half of one and two builders never clash."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path


@contextmanager
def building(target: Path) -> Iterator[Path]:
    """Yields a temporary directory beside `target`; on a clean exit it becomes `target`
    (where another process published it first, theirs is kept); it never outlives the block."""
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        yield tmp
        with suppress(OSError):  # another process built it first: theirs stays
            os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
