"""Embedded state: SQLite (tenants, hashed API keys, adapter metadata) and adapter files
under the data directory. Both survive a restart, and a kill at any instruction.

Adapter versions move through states, and files are only ever served through a `live` row:

    pending --(files renamed into a fresh v<N>/, fsynced; runner loaded them)--> live
    pending --(refused, or killed: recovery at start)--> aborted   (files removed)
    live    --(deleted, or replaced by a newer live version)--> deleted (files removed later)
    live    --(files missing or not matching sha256 at start)--> broken (files quarantined)

The row is written (pending, with the version reserved and the sha256 of the staged files)
before any file moves, and committed live last; `recovery.py` finishes or undoes whatever a
kill interrupted. SQLite runs in WAL mode with synchronous=FULL: a transaction that returned
is on the disk, so a 2xx answered after it survives power loss too. One connection, one
lock: one writer. The rows' types and the schema: records.py."""

from __future__ import annotations

import dataclasses
import json
import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from frontend.tenancy import durable
from frontend.tenancy.durable import StorageFull
from frontend.tenancy.records import (
    ADAPTER_COLUMNS,
    SCHEMA,
    STATES,
    TENANT_COLUMNS,
    AdapterRecord,
    Tenant,
    adapter_from_row,
    tenant_from_row,
)

log = logging.getLogger("punica_x.store")


class StoreError(RuntimeError):
    """The data directory or its database cannot be used (a start-up error)."""


class Store:
    def __init__(self, data_dir: Path) -> None:
        data_dir = Path(data_dir).resolve()  # rows name files by absolute path
        self.data_dir = data_dir
        self.adapter_dir = data_dir / "adapters"
        self.staging_dir = data_dir / "staging"
        self.quarantine_dir = data_dir / "quarantine"
        db_path = data_dir / "punica-x.sqlite3"
        try:
            for d in (self.adapter_dir, self.staging_dir, self.quarantine_dir):
                durable.make_dirs(d)
            self._db = sqlite3.connect(db_path, check_same_thread=False, isolation_level=None)
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA busy_timeout=10000")
            self._db.executescript(SCHEMA)
            self._migrate()
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open the data directory {data_dir} ({db_path}): {exc}") from (
                exc
            )
        if mode.lower() != "wal":
            log.warning(
                "SQLite cannot use WAL on this filesystem (journal_mode=%s); commits stay "
                "durable (synchronous=FULL) but readers wait on writers",
                mode,
            )
        self._lock = threading.Lock()

    def _migrate(self) -> None:
        """Databases from before adapter states had a `deleted` flag instead; those from
        before stored_dtype get the column, NULL in their rows (the API reports null: the
        dtype is recorded when the upload is parsed, and old rows are not re-read); tenants
        from before fair share get weight 1, from before prefix caching no sharing."""
        tenant_columns = {r[1] for r in self._db.execute("PRAGMA table_info(tenants)")}
        if "weight" not in tenant_columns:
            self._db.execute("ALTER TABLE tenants ADD COLUMN weight REAL NOT NULL DEFAULT 1.0")
        if "share_prefix_cache" not in tenant_columns:
            self._db.execute(
                "ALTER TABLE tenants ADD COLUMN share_prefix_cache INTEGER NOT NULL DEFAULT 0"
            )
        if "lora_source" not in tenant_columns:
            self._db.execute("ALTER TABLE tenants ADD COLUMN lora_source TEXT")
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(adapters)")}
        if "state" not in columns:
            self._db.execute("ALTER TABLE adapters ADD COLUMN state TEXT NOT NULL DEFAULT 'live'")
            self._db.execute("UPDATE adapters SET state = 'deleted' WHERE deleted = 1")
        if "stored_dtype" not in columns:
            self._db.execute("ALTER TABLE adapters ADD COLUMN stored_dtype TEXT")
        if "source" not in columns:
            self._db.execute("ALTER TABLE adapters ADD COLUMN source TEXT")
        if "pinned" not in columns:
            self._db.execute("ALTER TABLE adapters ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0")

    def _rows(self, sql: str, *args) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _transaction(self, body: Callable[[sqlite3.Connection], object]):
        """Run `body(db)` in one write transaction; out of disk space raises StorageFull."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    result = body(self._db)
                    self._db.execute("COMMIT")
                except BaseException:
                    if self._db.in_transaction:  # SQLITE_FULL may have rolled back already
                        self._db.execute("ROLLBACK")
                    raise
            except sqlite3.OperationalError as exc:
                if durable.is_out_of_space(exc):
                    raise StorageFull(str(exc)) from exc
                raise
            return result

    # -- tenants and keys ------------------------------------------------------------------
    def create_tenant(
        self,
        name: str,
        key_hash: str,
        prefix: str,
        max_concurrent: int | None,
        tokens_per_minute: int | None,
        weight: float = 1.0,
        share_prefix_cache: bool = False,
    ) -> Tenant:
        now = time.time()

        def insert(db):
            cur = db.execute(
                "INSERT INTO tenants (name, created, max_concurrent, tokens_per_minute, weight, "
                "share_prefix_cache) VALUES (?, ?, ?, ?, ?, ?)",
                (name, now, max_concurrent, tokens_per_minute, weight, int(share_prefix_cache)),
            )
            db.execute(
                "INSERT INTO api_keys (tenant_id, key_hash, prefix, created) VALUES (?, ?, ?, ?)",
                (cur.lastrowid, key_hash, prefix, now),
            )

        self._transaction(insert)
        return self.tenant_by_name(name)

    def tenant_by_name(self, name: str) -> Tenant | None:
        rows = self._rows(f"SELECT {TENANT_COLUMNS} FROM tenants WHERE name = ?", name)
        return tenant_from_row(rows[0]) if rows else None

    def tenants(self) -> list[Tenant]:
        return [
            tenant_from_row(r)
            for r in self._rows(f"SELECT {TENANT_COLUMNS} FROM tenants ORDER BY id")
        ]

    def set_tenant_weight(self, tenant_id: int, weight: float) -> None:
        self._transaction(
            lambda db: db.execute("UPDATE tenants SET weight = ? WHERE id = ?", (weight, tenant_id))
        )

    def set_tenant_sharing(self, tenant_id: int, share_prefix_cache: bool) -> None:
        self._transaction(
            lambda db: db.execute(
                "UPDATE tenants SET share_prefix_cache = ? WHERE id = ?",
                (int(share_prefix_cache), tenant_id),
            )
        )

    def set_tenant_source(self, tenant_id: int, uri: str | None) -> None:
        self._transaction(
            lambda db: db.execute(
                "UPDATE tenants SET lora_source = ? WHERE id = ?", (uri, tenant_id)
            )
        )

    def revoke_tenant(self, tenant_id: int) -> None:
        def revoke(db):
            db.execute("UPDATE tenants SET revoked = 1 WHERE id = ?", (tenant_id,))
            db.execute("UPDATE api_keys SET revoked = 1 WHERE tenant_id = ?", (tenant_id,))

        self._transaction(revoke)

    def tenant_by_key_hash(self, key_hash: str) -> tuple[Tenant, str] | None:
        """(tenant, stored hash) of a live key, for a constant-time comparison by the caller."""
        columns = ", ".join(f"t.{c.strip()}" for c in TENANT_COLUMNS.split(","))
        rows = self._rows(
            f"SELECT {columns}, k.key_hash FROM api_keys k JOIN tenants t ON t.id = k.tenant_id "
            "WHERE k.key_hash = ? AND k.revoked = 0 AND t.revoked = 0",
            key_hash,
        )
        return (tenant_from_row(rows[0][:-1]), rows[0][-1]) if rows else None

    # -- adapter files ----------------------------------------------------------------------
    def stage(self, files: dict[str, bytes]) -> Path:
        """Write an upload's files, durably, into a fresh staging directory. Out of space:
        StorageFull, with nothing left behind."""
        staging = self.staging_dir / uuid.uuid4().hex
        try:
            staging.mkdir()
            for name, data in files.items():
                durable.write_file(staging / name, data)
        except OSError as exc:
            durable.remove_tree(staging)
            if durable.is_out_of_space(exc):
                raise StorageFull(f"no space left for the upload: {exc}") from exc
            raise
        return staging

    def install(self, staging: Path, record: AdapterRecord) -> None:
        """Rename the staged files into the pending version's own directory. A directory
        already there (no row may name it: see recovery) is quarantined first, never merged."""
        durable.make_dirs(record.path.parent)
        if record.path.exists():
            moved = self.quarantine(record.path, "in the way of a new version")
            log.warning("%s was in the way of a new upload; moved to %s", record.path, moved)
        durable.rename(staging, record.path)

    def quarantine(self, path: Path, why: str) -> Path:
        """Move files that must never be served out of the adapter tree (kept for an
        operator: `<data>/quarantine/<time>-<path>`)."""
        rel = path.relative_to(self.data_dir) if path.is_relative_to(self.data_dir) else path
        dest = self.quarantine_dir / f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
        dest = dest.with_name(dest.name + "-" + "-".join(rel.parts[-3:]))
        durable.rename(path, dest)
        (self.quarantine_dir / (dest.name + ".why")).write_text(why + "\n")
        return dest

    def remove_files(self, path: Path) -> None:
        durable.remove_tree(path)

    # -- adapter rows -----------------------------------------------------------------------
    def reserve_adapter(
        self,
        tenant_id: int,
        name: str,
        rank: int,
        target_modules: tuple[str, ...],
        sha256: str,
        size_bytes: int,
        stored_dtype: str | None = None,
        source: str | None = None,
    ) -> AdapterRecord:
        """A `pending` row with the next version of `name` (never reused: versions of aborted,
        deleted and broken rows count) and the directory its files will move to."""

        def insert(db):
            (top,) = db.execute(
                "SELECT MAX(version) FROM adapters WHERE tenant_id = ? AND name = ?",
                (tenant_id, name),
            ).fetchone()
            version = (top or 0) + 1
            path = self.adapter_dir / str(tenant_id) / name / f"v{version}"
            cur = db.execute(
                "INSERT INTO adapters (tenant_id, name, version, rank, target_modules, sha256, "
                "size_bytes, path, created, state, stored_dtype, source) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?)",
                (
                    tenant_id,
                    name,
                    version,
                    rank,
                    json.dumps(list(target_modules)),
                    sha256,
                    size_bytes,
                    str(path),
                    time.time(),
                    stored_dtype,
                    source,
                ),
            )
            return cur.lastrowid

        return self.adapter_by_id(self._transaction(insert))

    def commit_adapter(self, record: AdapterRecord) -> tuple[AdapterRecord, list[AdapterRecord]]:
        """Make the pending version live and, in the same transaction, every older live
        version of its name deleted. Returns (the live record, the versions it replaced)."""

        def commit(db):
            older = db.execute(
                f"SELECT {ADAPTER_COLUMNS} FROM adapters WHERE tenant_id = ? AND name = ? "
                "AND version < ? AND state = 'live'",
                (record.tenant_id, record.name, record.version),
            ).fetchall()
            db.execute(
                "UPDATE adapters SET state = 'deleted' WHERE tenant_id = ? AND name = ? "
                "AND version < ? AND state = 'live'",
                (record.tenant_id, record.name, record.version),
            )
            n = db.execute(
                "UPDATE adapters SET state = 'live' WHERE id = ? AND state = 'pending'",
                (record.id,),
            ).rowcount
            if n != 1:
                raise RuntimeError(f"adapter row {record.id} is no longer pending")
            return [adapter_from_row(r) for r in older]

        replaced = self._transaction(commit)
        return self.adapter_by_id(record.id), replaced

    def set_state(self, record: AdapterRecord, state: str) -> None:
        assert state in STATES, state
        self._transaction(
            lambda db: db.execute("UPDATE adapters SET state = ? WHERE id = ?", (state, record.id))
        )

    def set_pinned(self, record: AdapterRecord, pinned: bool) -> AdapterRecord:
        """The version `record` pinned or not; the record as it is now."""
        self._transaction(
            lambda db: db.execute(
                "UPDATE adapters SET pinned = ? WHERE id = ?", (int(pinned), record.id)
            )
        )
        return dataclasses.replace(record, pinned=pinned)

    def count_pinned(self, tenant_id: int) -> int:
        """The tenant's live adapters that are pinned."""
        sql = "SELECT COUNT(*) FROM adapters WHERE tenant_id = ? AND state = 'live' AND pinned"
        return self._rows(sql, tenant_id)[0][0]

    def mark_deleted(self, record: AdapterRecord) -> None:
        self.set_state(record, "deleted")

    def adapter_by_id(self, adapter_id: int) -> AdapterRecord:
        rows = self._rows(f"SELECT {ADAPTER_COLUMNS} FROM adapters WHERE id = ?", adapter_id)
        return adapter_from_row(rows[0])

    def current_adapter(self, tenant_id: int, name: str) -> AdapterRecord | None:
        rows = self._rows(
            f"SELECT {ADAPTER_COLUMNS} FROM adapters WHERE tenant_id = ? AND name = ? "
            "AND state = 'live' ORDER BY version DESC LIMIT 1",
            tenant_id,
            name,
        )
        return adapter_from_row(rows[0]) if rows else None

    def count_adapters(self, tenant_id: int) -> int:
        """The tenant's live adapters (names with a current version)."""
        sql = "SELECT COUNT(*) FROM adapters WHERE tenant_id = ? AND state = 'live'"
        return self._rows(sql, tenant_id)[0][0]

    def adapters(self, tenant_id: int | None = None) -> list[AdapterRecord]:
        """The live version of each adapter, of one tenant or all."""
        sql = f"SELECT {ADAPTER_COLUMNS} FROM adapters WHERE state = 'live'"
        args: tuple = ()
        if tenant_id is not None:
            sql += " AND tenant_id = ?"
            args = (tenant_id,)
        return [adapter_from_row(r) for r in self._rows(sql + " ORDER BY name", *args)]

    def adapters_page(self, tenant_id: int, after: str, limit: int) -> list[AdapterRecord]:
        """The tenant's live adapters named after `after` ("" from the first), by name, at
        most `limit` of them."""
        sql = (
            f"SELECT {ADAPTER_COLUMNS} FROM adapters WHERE state = 'live' AND tenant_id = ? "
            "AND name > ? ORDER BY name LIMIT ?"
        )
        return [adapter_from_row(r) for r in self._rows(sql, tenant_id, after, limit)]

    def adapters_in(self, *states: str) -> list[AdapterRecord]:
        marks = ", ".join("?" * len(states))
        return [
            adapter_from_row(r)
            for r in self._rows(
                f"SELECT {ADAPTER_COLUMNS} FROM adapters WHERE state IN ({marks}) ORDER BY id",
                *states,
            )
        ]

    def adapter_paths(self) -> set[Path]:
        """The directory of every row, whatever its state."""
        return {Path(r[0]) for r in self._rows("SELECT path FROM adapters")}
