"""One adapter name's uploads, loads and deletes run one at a time (TenantAdapters._lock),
and a name's lock is forgotten once nobody holds or waits for it, so the names a tenant
only tried (a refused load, a hostile stream of names) leave nothing behind."""

from __future__ import annotations

import asyncio

from frontend.tenancy.tenant_adapters import TenantAdapters


def test_one_at_a_time_and_forgotten_after():
    adapters = TenantAdapters(None, None, "base")
    order = []

    async def hold(tag, key="t1/a"):
        async with adapters._lock(key):
            order.append(f"{tag} in")
            await asyncio.sleep(0.01)
            order.append(f"{tag} out")

    async def main():
        await asyncio.gather(hold("x"), hold("y"), hold("z", key="t1/b"))
        assert adapters._locks == {}
        waiter = asyncio.ensure_future(hold("late"))
        async with adapters._lock("t1/a"):
            await asyncio.sleep(0)  # the waiter queues behind this holder
            waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert adapters._locks == {}
        try:
            async with adapters._lock("t2/c"):
                raise ValueError("a refused load")
        except ValueError:
            pass
        assert adapters._locks == {}

    asyncio.run(main())
    assert order.index("x out") < order.index("y in")  # one name: one at a time
    assert order.index("z in") < order.index("x out")  # another name does not wait


def test_new_names_stored_side_by_side_cannot_pass_one_count():
    """max_per_tenant=2 and five new names at once, each under its own name's lock: two are
    stored, three are 403, as if they had come one after another; a failed one frees its
    place."""
    from types import SimpleNamespace

    import pytest

    from frontend.http.errors import ApiError

    live: set[str] = set()
    store = SimpleNamespace(
        current_adapter=lambda tenant_id, name: None,
        count_adapters=lambda tenant_id: len(live),
    )
    adapters = TenantAdapters(store, None, "base", max_per_tenant=2)
    tenant = SimpleNamespace(id=1)

    async def stored(tenant, name, key, files, source, previous):
        await asyncio.sleep(0.01)  # staging, the runners' load: other names arrive meanwhile
        if name == "fails":
            raise OSError("disk")
        live.add(name)
        return name

    adapters._store_and_serve = stored

    async def main(names):
        calls = (adapters.upload(tenant, n, {}) for n in names)
        return await asyncio.gather(*calls, return_exceptions=True)

    got = asyncio.run(main(["a", "b", "c", "d", "e"]))
    assert sorted(g for g in got if isinstance(g, str)) == ["a", "b"]
    refused = [g for g in got if isinstance(g, ApiError)]
    assert len(refused) == 3 and {(e.status, e.code) for e in refused} == {
        (403, "adapter_quota_exceeded")
    }
    live.clear()
    got = asyncio.run(main(["fails", "x"]))
    assert isinstance(got[0], OSError) and got[1] == "x"
    assert asyncio.run(main(["y"])) == ["y"] and adapters._arriving == {}
    with pytest.raises(ApiError):
        asyncio.run(adapters.upload(tenant, "z", {}))
