"""File writes that survive a kill or a power loss at any instruction: data fsynced before
it is named, renames fsynced through their parent directory, and out-of-space turned into
one exception the API answers with 507."""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
from pathlib import Path

OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)


class StorageFull(Exception):
    """The disk (or quota) holding the data directory is full; nothing was left half-written."""


def is_out_of_space(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in OUT_OF_SPACE:
        return True
    # SQLite reports SQLITE_FULL as an OperationalError with this text.
    return isinstance(exc, sqlite3.OperationalError) and "disk is full" in str(exc)


def write_file(path: Path, data: bytes) -> None:
    """Create `path` (it must not exist) holding `data`, flushed to the disk."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (creations, renames, removals in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """mkdir -p, with every directory it creates made durable in its parent."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        fsync_dir(d.parent)


def rename(src: Path, dst: Path) -> None:
    """Atomic rename; `dst` must not exist (a directory in the way is never merged into)."""
    if dst.exists():
        raise FileExistsError(errno.EEXIST, "destination exists", str(dst))
    os.rename(src, dst)
    fsync_dir(dst.parent)
    if src.parent != dst.parent:
        fsync_dir(src.parent)


def remove_tree(path: Path) -> None:
    """Remove a directory tree (absent is fine) and make the removal durable."""
    if not path.exists():
        return
    shutil.rmtree(path)
    fsync_dir(path.parent)
