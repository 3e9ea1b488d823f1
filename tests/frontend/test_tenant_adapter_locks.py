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
