"""The adapter store's write order and its start-up recovery, without a server: every trace a
kill can leave is finished or undone, and nothing without a committed row is served."""

from __future__ import annotations

import errno
import sqlite3

import pytest

from frontend.tenancy import durable
from frontend.tenancy.durable import StorageFull
from frontend.tenancy.recovery import recover
from frontend.tenancy.store import Store, StoreError

FILES = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"weights"}


def _store(tmp_path) -> tuple[Store, int]:
    store = Store(tmp_path / "data")
    tenant = store.create_tenant("t", "hash", "pfx", None, None)
    return store, tenant.id


def _reserve(store, tenant_id, name="x", sha="s1"):
    return store.reserve_adapter(tenant_id, name, 4, ("q_proj",), sha, 9)


def _upload(store, tenant_id, name="x", sha="s1"):
    """The manager's order, without the runners: stage, reserve, install, commit."""
    staging = store.stage(FILES)
    pending = _reserve(store, tenant_id, name, sha)
    store.install(staging, pending)
    return store.commit_adapter(pending)


def test_commit_makes_live_and_retires_older_versions(tmp_path):
    store, tid = _store(tmp_path)
    first, replaced = _upload(store, tid, sha="s1")
    assert (first.version, first.state, replaced) == (1, "live", [])
    assert sorted(p.name for p in first.path.iterdir()) == sorted(FILES)
    second, replaced = _upload(store, tid, sha="s2")
    assert second.version == 2 and [r.id for r in replaced] == [first.id]
    assert store.current_adapter(tid, "x").sha256 == "s2"
    assert [a.version for a in store.adapters(tid)] == [2]
    assert store.adapter_by_id(first.id).state == "deleted"


def test_pending_is_never_current_and_versions_are_never_reused(tmp_path):
    store, tid = _store(tmp_path)
    pending = _reserve(store, tid)
    assert pending.state == "pending" and store.current_adapter(tid, "x") is None
    store.set_state(pending, "aborted")
    assert _reserve(store, tid).version == 2


def test_recovery_finishes_what_a_kill_interrupted(tmp_path):
    store, tid = _store(tmp_path)
    live, _ = _upload(store, tid, "live")
    # killed after the version was reserved and the files moved, before the commit
    interrupted = _reserve(store, tid, "cut")
    store.install(store.stage(FILES), interrupted)
    # killed after a delete was recorded, before its files went
    gone, _ = _upload(store, tid, "gone")
    store.mark_deleted(gone)
    # killed while staging an upload
    leftover = store.stage(FILES)
    # a version directory no row names (what the old write order left after a kill)
    orphan = store.adapter_dir / str(tid) / "live" / "v2"
    orphan.mkdir()
    (orphan / "adapter_model.safetensors").write_bytes(b"someone else's weights")

    lines = recover(Store(store.data_dir))

    assert len(lines) == 4, lines
    assert not leftover.exists() and list(store.staging_dir.iterdir()) == []
    assert store.adapter_by_id(interrupted.id).state == "aborted"
    assert not interrupted.path.exists() and not gone.path.exists()
    assert not orphan.exists()
    quarantined = [p for p in store.quarantine_dir.iterdir() if p.is_dir()]
    assert len(quarantined) == 1
    assert (quarantined[0] / "adapter_model.safetensors").read_bytes() == b"someone else's weights"
    assert [a.name for a in store.adapters(tid)] == ["live"] and live.path.exists()
    assert recover(Store(store.data_dir)) == []  # idempotent


def test_a_new_version_never_merges_into_a_directory_in_its_way(tmp_path):
    store, tid = _store(tmp_path)
    _upload(store, tid)
    in_the_way = store.adapter_dir / str(tid) / "x" / "v2"
    in_the_way.mkdir()
    (in_the_way / "adapter_model.safetensors").write_bytes(b"stale")
    record, _ = _upload(store, tid, sha="s2")
    assert record.path == in_the_way
    assert (record.path / "adapter_model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in record.path.iterdir()) == sorted(FILES)


def test_out_of_space_while_staging_leaves_nothing(tmp_path, monkeypatch):
    store, _ = _store(tmp_path)
    real = durable.write_file

    def half_then_full(path, data):
        if path.name == "adapter_model.safetensors":
            path.write_bytes(data[:3])
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(durable, "write_file", half_then_full)
    with pytest.raises(StorageFull):
        store.stage(FILES)
    assert list(store.staging_dir.iterdir()) == []


def test_database_full_is_storage_full(tmp_path):
    store, tid = _store(tmp_path)
    store._db.execute("PRAGMA max_page_count = 1")  # SQLITE_FULL on the next growth
    big = "s" * 100_000
    with pytest.raises(StorageFull):
        _reserve(store, tid, sha=big)
    assert store.current_adapter(tid, "x") is None


def test_database_that_cannot_be_opened_is_a_clear_error(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "punica-x.sqlite3").write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="cannot open the data directory"):
        Store(data)


def test_durability_settings(tmp_path):
    store, _ = _store(tmp_path)
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_databases_from_before_states_migrate(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    db = sqlite3.connect(data / "punica-x.sqlite3")
    db.executescript(
        """
        CREATE TABLE adapters (
            id INTEGER PRIMARY KEY, tenant_id INTEGER NOT NULL, name TEXT NOT NULL,
            version INTEGER NOT NULL, rank INTEGER NOT NULL, target_modules TEXT NOT NULL,
            sha256 TEXT NOT NULL, size_bytes INTEGER NOT NULL, path TEXT NOT NULL,
            created REAL NOT NULL, deleted INTEGER NOT NULL DEFAULT 0,
            UNIQUE (tenant_id, name, version));
        INSERT INTO adapters VALUES (1, 1, 'x', 1, 4, '[]', 'old', 1, '/nowhere/v1', 0, 1);
        INSERT INTO adapters VALUES (2, 1, 'x', 2, 4, '[]', 'new', 1, '/nowhere/v2', 0, 0);
        """
    )
    db.commit()
    db.close()
    store = Store(data)
    assert [(a.version, a.state) for a in store.adapters_in(*("live", "deleted"))] == [
        (1, "deleted"),
        (2, "live"),
    ]
    assert _reserve(store, 1).version == 3


def test_stored_dtype_is_kept_and_reported_with_the_serving_dtype(tmp_path):
    store, tid = _store(tmp_path)
    staging = store.stage(FILES)
    pending = store.reserve_adapter(tid, "x", 4, ("q_proj",), "s1", 9, "float16")
    store.install(staging, pending)
    store.commit_adapter(pending)
    store = Store(tmp_path / "data")  # a restart reads it back
    (record,) = store.adapters(tid)
    assert record.stored_dtype == "float16"
    assert record.public("bfloat16")["dtype"] == {"stored": "float16", "serving": "bfloat16"}


def test_databases_from_before_stored_dtype_migrate(tmp_path):
    """The schema of the previous release (states, no stored_dtype): its rows keep working
    and report a stored dtype of null; new rows record theirs."""
    data = tmp_path / "data"
    data.mkdir()
    db = sqlite3.connect(data / "punica-x.sqlite3")
    db.executescript(
        """
        CREATE TABLE tenants (
            id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, created REAL NOT NULL,
            revoked INTEGER NOT NULL DEFAULT 0, max_concurrent INTEGER, tokens_per_minute INTEGER);
        CREATE TABLE adapters (
            id INTEGER PRIMARY KEY, tenant_id INTEGER NOT NULL REFERENCES tenants(id),
            name TEXT NOT NULL, version INTEGER NOT NULL, rank INTEGER NOT NULL,
            target_modules TEXT NOT NULL, sha256 TEXT NOT NULL, size_bytes INTEGER NOT NULL,
            path TEXT NOT NULL, created REAL NOT NULL, state TEXT NOT NULL DEFAULT 'live',
            UNIQUE (tenant_id, name, version));
        INSERT INTO tenants VALUES (1, 't', 0, 0, NULL, NULL);
        INSERT INTO adapters VALUES (1, 1, 'old', 1, 4, '["q_proj"]', 's', 9, '/nowhere/v1', 0,
            'live');
        """
    )
    db.commit()
    db.close()
    store = Store(data)
    (old,) = store.adapters(1)
    assert (old.name, old.state, old.stored_dtype, old.source) == ("old", "live", None, None)
    assert old.public("float32")["dtype"] == {"stored": None, "serving": "float32"}
    new = store.reserve_adapter(1, "new", 4, ("q_proj",), "s2", 9, "bfloat16", "lora/new")
    assert store.adapter_by_id(new.id).stored_dtype == "bfloat16"
    assert store.adapter_by_id(new.id).public("float32")["source"] == "lora/new"
    assert store.tenant_by_name("t").lora_source is None  # tenants from before: the root
    store.set_tenant_source(1, "s3://adapters/teams/t")
    again = Store(data)  # opening a migrated database again changes nothing else
    assert again.tenant_by_name("t").lora_source == "s3://adapters/teams/t"
    again.set_tenant_source(1, None)
    assert [t.lora_source for t in again.tenants()] == [None]


def test_admin_token_is_written_whole(tmp_path):
    from frontend.tenancy.auth import ensure_admin_token

    token, path, created = ensure_admin_token(tmp_path)
    assert created and path.read_text() == token + "\n"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert ensure_admin_token(tmp_path) == (token, path, False)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left
    path.write_text("")  # what a kill between create and write left before
    with pytest.raises(StoreError, match="is empty; delete it"):
        ensure_admin_token(tmp_path)


def test_an_existing_admin_token_with_a_loose_mode_is_reused_as_is(tmp_path):
    from frontend.tenancy.auth import ensure_admin_token

    path = tmp_path / "admin_token"
    path.write_text("pxa-operator-made\n")
    path.chmod(0o644)
    assert ensure_admin_token(tmp_path) == ("pxa-operator-made", path, False)
    assert oct(path.stat().st_mode & 0o777) == "0o644"  # not rewritten, not re-moded
