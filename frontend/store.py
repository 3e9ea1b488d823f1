"""Embedded state: SQLite (tenants, hashed API keys, adapter metadata) and adapter files
under the data directory. Both survive a restart. Thread-safe (one connection, one lock)."""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, created REAL NOT NULL,
    revoked INTEGER NOT NULL DEFAULT 0, max_concurrent INTEGER, tokens_per_minute INTEGER);
CREATE TABLE IF NOT EXISTS api_keys (
    id INTEGER PRIMARY KEY, tenant_id INTEGER NOT NULL REFERENCES tenants(id),
    key_hash TEXT NOT NULL UNIQUE, prefix TEXT NOT NULL, created REAL NOT NULL,
    revoked INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS adapters (
    id INTEGER PRIMARY KEY, tenant_id INTEGER NOT NULL REFERENCES tenants(id), name TEXT NOT NULL,
    version INTEGER NOT NULL, rank INTEGER NOT NULL, target_modules TEXT NOT NULL,
    sha256 TEXT NOT NULL, size_bytes INTEGER NOT NULL, path TEXT NOT NULL, created REAL NOT NULL,
    deleted INTEGER NOT NULL DEFAULT 0, UNIQUE (tenant_id, name, version));
"""


@dataclass(frozen=True)
class Tenant:
    id: int
    name: str
    created: float
    revoked: bool
    max_concurrent: int | None
    tokens_per_minute: int | None


@dataclass(frozen=True)
class AdapterRecord:
    id: int
    tenant_id: int
    name: str
    version: int
    rank: int
    target_modules: tuple[str, ...]
    sha256: str
    size_bytes: int
    path: Path
    created: float

    def public(self) -> dict:
        return {
            "id": f"adapter-{self.id}",
            "name": self.name,
            "version": self.version,
            "rank": self.rank,
            "target_modules": list(self.target_modules),
            "sha256": self.sha256,
            "size_bytes": self.size_bytes,
            "created": int(self.created),
        }


class Store:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        self.adapter_dir = data_dir / "adapters"
        self.staging_dir = data_dir / "staging"
        for d in (self.adapter_dir, self.staging_dir):
            d.mkdir(exist_ok=True)
        self._db = sqlite3.connect(
            data_dir / "punica-x.sqlite3", check_same_thread=False, isolation_level=None
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()

    def _rows(self, sql: str, *args) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- tenants and keys ------------------------------------------------------------------
    def create_tenant(
        self,
        name: str,
        key_hash: str,
        prefix: str,
        max_concurrent: int | None,
        tokens_per_minute: int | None,
    ) -> Tenant:
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN")
            try:
                cur = self._db.execute(
                    "INSERT INTO tenants (name, created, max_concurrent, tokens_per_minute) "
                    "VALUES (?, ?, ?, ?)",
                    (name, now, max_concurrent, tokens_per_minute),
                )
                self._db.execute(
                    "INSERT INTO api_keys (tenant_id, key_hash, prefix, created) "
                    "VALUES (?, ?, ?, ?)",
                    (cur.lastrowid, key_hash, prefix, now),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return self.tenant_by_name(name)

    def tenant_by_name(self, name: str) -> Tenant | None:
        rows = self._rows("SELECT * FROM tenants WHERE name = ?", name)
        return _tenant(rows[0]) if rows else None

    def tenants(self) -> list[Tenant]:
        return [_tenant(r) for r in self._rows("SELECT * FROM tenants ORDER BY id")]

    def revoke_tenant(self, tenant_id: int) -> None:
        with self._lock:
            self._db.execute("UPDATE tenants SET revoked = 1 WHERE id = ?", (tenant_id,))
            self._db.execute("UPDATE api_keys SET revoked = 1 WHERE tenant_id = ?", (tenant_id,))

    def tenant_by_key_hash(self, key_hash: str) -> tuple[Tenant, str] | None:
        """(tenant, stored hash) of a live key, for a constant-time comparison by the caller."""
        rows = self._rows(
            "SELECT t.*, k.key_hash FROM api_keys k JOIN tenants t ON t.id = k.tenant_id "
            "WHERE k.key_hash = ? AND k.revoked = 0 AND t.revoked = 0",
            key_hash,
        )
        return (_tenant(rows[0][:6]), rows[0][6]) if rows else None

    # -- adapters ---------------------------------------------------------------------------
    def next_version(self, tenant_id: int, name: str) -> int:
        rows = self._rows(
            "SELECT MAX(version) FROM adapters WHERE tenant_id = ? AND name = ?", tenant_id, name
        )
        return (rows[0][0] or 0) + 1

    def add_adapter(
        self,
        tenant_id: int,
        name: str,
        version: int,
        rank: int,
        target_modules: tuple[str, ...],
        sha256: str,
        size_bytes: int,
        path: Path,
    ) -> AdapterRecord:
        with self._lock:
            self._db.execute(
                "INSERT INTO adapters (tenant_id, name, version, rank, target_modules, sha256, "
                "size_bytes, path, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
                ),
            )
        return self.current_adapter(tenant_id, name)

    def current_adapter(self, tenant_id: int, name: str) -> AdapterRecord | None:
        rows = self._rows(
            "SELECT * FROM adapters WHERE tenant_id = ? AND name = ? AND deleted = 0 "
            "ORDER BY version DESC LIMIT 1",
            tenant_id,
            name,
        )
        return _adapter(rows[0]) if rows else None

    def adapters(self, tenant_id: int | None = None) -> list[AdapterRecord]:
        """The current (highest live) version of each adapter, of one tenant or all."""
        sql = (
            "SELECT * FROM adapters a WHERE deleted = 0 AND version = (SELECT MAX(version) FROM "
            "adapters b WHERE b.tenant_id = a.tenant_id AND b.name = a.name AND b.deleted = 0)"
        )
        args: tuple = ()
        if tenant_id is not None:
            sql += " AND tenant_id = ?"
            args = (tenant_id,)
        return [_adapter(r) for r in self._rows(sql + " ORDER BY name", *args)]

    def older_versions(self, tenant_id: int, name: str, below: int) -> list[AdapterRecord]:
        return [
            _adapter(r)
            for r in self._rows(
                "SELECT * FROM adapters WHERE tenant_id = ? AND name = ? AND version < ? "
                "AND deleted = 0",
                tenant_id,
                name,
                below,
            )
        ]

    def mark_deleted(self, record: AdapterRecord) -> None:
        with self._lock:
            self._db.execute("UPDATE adapters SET deleted = 1 WHERE id = ?", (record.id,))

    def remove_files(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)


def _tenant(row) -> Tenant:
    return Tenant(row[0], row[1], row[2], bool(row[3]), row[4], row[5])


def _adapter(row) -> AdapterRecord:
    return AdapterRecord(
        row[0],
        row[1],
        row[2],
        row[3],
        row[4],
        tuple(json.loads(row[5])),
        row[6],
        row[7],
        Path(row[8]),
        row[9],
    )
