"""A benchmark's scratch folder (its adapters, server data, logs), removed when the process
exits: a run writes 0.3-1 GB of PEFT adapters there, and runs that kept theirs in /tmp
filled a VM's 55 GB disk (81 folders on 2026-11-26)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path


def scratch_dir(prefix: str) -> Path:
    """A new folder under the system's temp folder, removed with everything in it when the
    interpreter exits, normally or by an uncaught exception (not on SIGKILL)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path
