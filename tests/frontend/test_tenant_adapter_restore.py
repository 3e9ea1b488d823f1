"""After a restart the stored adapters are registered again several names at a time
(TenantAdapters.restore, RESTORE_CONCURRENCY), each name's versions in the store's order,
and one whose files are refused is marked broken without holding up the others."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from frontend.tenancy import tenant_adapters
from frontend.tenancy.tenant_adapters import RESTORE_CONCURRENCY, TenantAdapters
from punica_x.api import AdapterError


def _record(i: int, name: str) -> SimpleNamespace:
    return SimpleNamespace(id=i, tenant_id=1, name=name, version=i, path=Path(f"/nowhere/{i}"),
                           sha256=f"sha{i}", pinned=False)  # fmt: skip


def test_restore_runs_names_side_by_side_and_a_names_versions_in_order():
    records = [_record(i, f"n{i}") for i in range(12)] + [_record(12, "n0"), _record(13, "bad")]
    broken = []
    store = SimpleNamespace(
        adapters=lambda: records,
        set_state=lambda record, state: broken.append((record.name, state)),
        quarantine=lambda path, why: None,
    )
    events, running, peak = [], set(), [0]

    async def register_adapter(key, path, sha256, version=None, pinned=None):
        running.add(version)
        peak[0] = max(peak[0], len(running))
        events.append(("start", key, version))
        await asyncio.sleep(0.02)
        running.discard(version)
        events.append(("end", key, version))
        if key == "t1/bad":
            raise AdapterError("sha256_mismatch", "not the files the row committed")

    adapters = TenantAdapters(store, SimpleNamespace(register_adapter=register_adapter), "base")
    asyncio.run(adapters.restore())
    assert peak[0] == RESTORE_CONCURRENCY  # side by side, never more
    assert {v for kind, _, v in events if kind == "end"} == set(range(14))  # every one tried
    n0 = [(kind, v) for kind, key, v in events if key == "t1/n0"]
    assert n0 == [("start", 0), ("end", 0), ("start", 12), ("end", 12)]  # one name: in order
    assert broken == [("bad", "broken")]


def test_one_at_a_time_when_the_limit_is_one(monkeypatch):
    monkeypatch.setattr(tenant_adapters, "RESTORE_CONCURRENCY", 1)
    records = [_record(i, f"n{i}") for i in range(5)]
    store = SimpleNamespace(adapters=lambda: records)
    order = []

    async def register_adapter(key, path, sha256, version=None, pinned=None):
        order.append(("start", version))
        await asyncio.sleep(0.005)
        order.append(("end", version))

    adapters = TenantAdapters(store, SimpleNamespace(register_adapter=register_adapter), "base")
    asyncio.run(adapters.restore())
    assert order == [(k, v) for v in range(5) for k in ("start", "end")]
