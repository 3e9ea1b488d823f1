"""Start-up repair of the adapter store after a kill, before anything is served.

A kill can interrupt an upload or a delete anywhere; `store.py`'s write order leaves only
these traces, each finished or undone here with one log line:

- staging leftovers (an upload killed before its row was written): removed;
- `pending` rows (killed after the version was reserved, before the commit; the client got
  no 2xx): files removed, row `aborted`;
- `deleted` / `aborted` rows whose files are still there: files removed;
- directories under `adapters/` that no row names (left by older releases, or by hand):
  quarantined, never served, and never merged into by a later upload.

Rows that are `live` but whose files are missing or do not match their sha256 are found when
the runners load them (`FrontendManager.restore_adapters`), and marked `broken`."""

from __future__ import annotations

import logging
from pathlib import Path

from frontend.tenancy.store import Store

log = logging.getLogger("punica_x.store")


def recover(store: Store) -> list[str]:
    """Repair `store` as described above; returns the log lines (also logged, WARNING)."""
    lines: list[str] = []

    def note(msg: str, *args) -> None:
        lines.append(msg % args)
        log.warning(msg, *args)

    for leftover in sorted(store.staging_dir.iterdir()):
        if leftover.is_dir():
            store.remove_files(leftover)
        else:
            leftover.unlink()
        note("removed staging leftover %s (an upload interrupted before it was recorded)", leftover)
    for record in store.adapters_in("pending"):
        store.remove_files(record.path)
        store.set_state(record, "aborted")
        note(
            "upload of adapter %r v%d (tenant %d) was interrupted before its commit: "
            "files removed, never served",
            record.name,
            record.version,
            record.tenant_id,
        )
    for record in store.adapters_in("deleted", "aborted"):
        if record.path.exists():
            store.remove_files(record.path)
            note(
                "finished removing the files of %s adapter %r v%d (tenant %d)",
                record.state,
                record.name,
                record.version,
                record.tenant_id,
            )
    named = {p.resolve() for p in store.adapter_paths()}
    for version_dir in _version_dirs(store.adapter_dir):
        if version_dir.resolve() not in named:
            moved = store.quarantine(version_dir, "no database row names this directory")
            note("quarantined %s: no database row names it (moved to %s)", version_dir, moved)
    return lines


def _version_dirs(root: Path) -> list[Path]:
    """adapters/<tenant>/<name>/<version> directories (anything at that depth)."""
    return sorted(p for t in _dirs(root) for n in _dirs(t) for p in n.iterdir())


def _dirs(path: Path) -> list[Path]:
    return [p for p in path.iterdir() if p.is_dir()]
