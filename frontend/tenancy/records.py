"""What the server's database holds: its schema, and its rows as frozen types (a tenant, an
adapter version; store.py reads and writes them, its docstring has the versions' states)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, created REAL NOT NULL,
    revoked INTEGER NOT NULL DEFAULT 0, max_concurrent INTEGER, tokens_per_minute INTEGER,
    weight REAL NOT NULL DEFAULT 1.0, share_prefix_cache INTEGER NOT NULL DEFAULT 0,
    lora_source TEXT);
CREATE TABLE IF NOT EXISTS api_keys (
    id INTEGER PRIMARY KEY, tenant_id INTEGER NOT NULL REFERENCES tenants(id),
    key_hash TEXT NOT NULL UNIQUE, prefix TEXT NOT NULL, created REAL NOT NULL,
    revoked INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS adapters (
    id INTEGER PRIMARY KEY, tenant_id INTEGER NOT NULL REFERENCES tenants(id), name TEXT NOT NULL,
    version INTEGER NOT NULL, rank INTEGER NOT NULL, target_modules TEXT NOT NULL,
    sha256 TEXT NOT NULL, size_bytes INTEGER NOT NULL, path TEXT NOT NULL, created REAL NOT NULL,
    state TEXT NOT NULL DEFAULT 'live', stored_dtype TEXT, source TEXT,
    pinned INTEGER NOT NULL DEFAULT 0,
    UNIQUE (tenant_id, name, version));
"""
TENANT_COLUMNS = (
    "id, name, created, revoked, max_concurrent, tokens_per_minute, weight, share_prefix_cache, "
    "lora_source"
)
ADAPTER_COLUMNS = (
    "id, tenant_id, name, version, rank, target_modules, sha256, size_bytes, path, created, "
    "state, stored_dtype, source, pinned"
)
STATES = ("pending", "live", "deleted", "aborted", "broken")


@dataclass(frozen=True)
class Tenant:
    id: int
    name: str
    created: float
    revoked: bool
    max_concurrent: int | None
    tokens_per_minute: int | None
    weight: float = (
        1.0  # its share of the runners while tenants wait (scheduler/policy/fairness.py)
    )
    # its base-model requests share prefix-cached KV with other tenants that allow it
    # (frontend/tenancy/cache_scope.py); adapter requests never do
    share_prefix_cache: bool = False
    # its own adapter source, an object-store URI the operator set (tenant_sources.py); None:
    # <tenant>/ under the server's --lora-source-root
    lora_source: str | None = None


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
    state: str = "live"
    # dtype of the uploaded A/B tensors ("float16"; "bfloat16,float32" when the file mixes
    # them); None for rows from before the column existed (reported as null)
    stored_dtype: str | None = None
    # the lora_path it was loaded from (POST /v1/load_lora_adapter); None for an upload
    source: str | None = None
    # kept on the runners' devices (PATCH /v1/adapters/{name}); a new version inherits it
    pinned: bool = False

    def public(self, serving_dtype: str) -> dict:
        """The API's view; serving_dtype: the runners' dtype, which the adapter is cast to."""
        return {
            "id": f"adapter-{self.id}",
            "name": self.name,
            "version": self.version,
            "rank": self.rank,
            "target_modules": list(self.target_modules),
            "sha256": self.sha256,
            "size_bytes": self.size_bytes,
            "created": int(self.created),
            "dtype": {"stored": self.stored_dtype, "serving": serving_dtype},
            "source": self.source,
            "pinned": self.pinned,
        }


def tenant_from_row(row) -> Tenant:
    return Tenant(
        row[0], row[1], row[2], bool(row[3]), row[4], row[5], row[6], bool(row[7]), row[8]
    )


def adapter_from_row(row) -> AdapterRecord:
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
        row[10],
        row[11],
        row[12],
        bool(row[13]),
    )
