"""The scheduler's one view of DistKV: a KVGroup, whatever the runners' backend.

The scheduler adds a runner to the group before the runner takes work (`join`), takes it out
when it dies or drains (`leave`: what it lent goes with it, its debtors recompute), asks
`defragment` from time to time (DGFM: debt cycles swapped home, the cycle's runners held
between two steps meanwhile) and `shutdown` at the end. Two implementations:

- ThreadKVGroup (here): thread runners in this process, one KVNetwork (network.py) with the
  ledger in memory; DGFM holds the runners with `paused`;
- RayKVGroup (ray_group.py): runner processes, the ledger in an actor of its own, the data
  plane over channel.py; DGFM by actor calls.

`make_kv_group` picks one from the runners' backend (None: DistKV off, or runners of two
backends)."""

from __future__ import annotations

import logging
from typing import Protocol

from punica_x.api import in_side_thread
from scheduler.distkv.dgfm import Swap, plan_swaps
from scheduler.distkv.network import KVNetwork, default_caps

log = logging.getLogger(__name__)


class KVGroup(Protocol):
    def join(self, handle) -> None:
        """Blocking: run it off the event loop. The runner lends and may borrow."""

    def leave(self, runner_id: str, dead: bool) -> None:
        """The runner left: its loans are freed on the others; what it lent is gone."""

    async def defragment(self, slots: dict[str, object], min_swap: int) -> list[Swap]:
        """DGFM among `slots` (runner id -> handle of every live runner): the swaps done."""

    def has_work(self) -> bool:
        """Whether a DGFM pass may find something (debts outstanding, or unknown here)."""

    def shutdown(self) -> None: ...


def paused(handles, fn):
    """Run fn (on this thread) while every runner in `handles` is held between two steps
    (AsyncEngine.hold)."""
    releases = []
    try:
        for h in handles:
            releases.append(h.async_engine.hold(timeout=30.0, limit=60.0))
        return fn()
    finally:
        for release in releases:
            release()


class ThreadKVGroup:
    """Thread runners of this process over one KVNetwork. overlap: run peers' micro-attention
    on worker threads while the local part runs (off by default: thread runners share the
    CPU's cores, and there it measured slower, bench_distkv)."""

    def __init__(self, lend_fraction: float = 0.9, overlap: bool = False) -> None:
        self.lend_fraction, self.overlap = lend_fraction, overlap
        self.network = KVNetwork()

    def join(self, handle) -> None:
        engine = getattr(handle, "engine", None)
        if engine is None:
            return
        if engine.swap is not None:
            log.warning("runner %s runs the mlfq policy: no part in DistKV", handle.runner_id)
            return
        net, rid = self.network, handle.runner_id
        caps = default_caps(handle.info.kv_blocks_total, self.lend_fraction)
        borrower = net.add_runner(rid)
        rm = engine.distkv.enable(rid, borrower, caps, self.overlap, pool=net.pool)
        net.attach(rid, rm, getattr(handle, "node", ""))

    def leave(self, runner_id: str, dead: bool) -> None:
        self.network.remove(runner_id, dead)

    async def defragment(self, slots: dict[str, object], min_swap: int) -> list[Swap]:
        net = self.network
        swaps, _ = plan_swaps(net.ledger.debts(), min_swap)
        rids = {r for s in swaps for r in s.cycle}
        if not swaps or not rids <= set(slots):
            return []  # nothing to do, or a runner on a cycle is gone
        handles = [slots[r] for r in rids]
        engines = {r: slots[r].engine for r in rids}
        # the blocks are copied with torch ops: on a thread of its own (punica_x.side_thread)
        return await in_side_thread(paused, handles, lambda: net.defragment(engines, min_swap))

    def has_work(self) -> bool:
        return bool(self.network.ledger.debts())

    def shutdown(self) -> None:
        self.network.shutdown()


def make_kv_group(
    backends: set[str], lend_fraction: float, overlap: bool, transport: str
) -> KVGroup | None:
    """The group for runners of `backends` (Ray runners always overlap: their own processes),
    None when they mix backends."""
    if backends == {"ray"}:
        from scheduler.distkv.ray_group import RayKVGroup

        return RayKVGroup(lend_fraction, overlap=True, transport=transport)
    if backends == {"thread"}:
        return ThreadKVGroup(lend_fraction, overlap)
    if "process" in backends:
        log.warning("DistKV is for thread and Ray runners, not engine processes; it is off")
        return None
    log.warning("DistKV needs runners of one backend; it is off")
    return None
