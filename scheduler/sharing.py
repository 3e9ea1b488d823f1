"""Fair share of the batch slots (scheduler/policy/fairness.py's `rebalance`, VTC): while requests
wait and no runner has room, a tenant below its share of the slots takes one from the
tenant furthest above its share. That tenant's newest request that frees room enough goes
back to the queue (a move: its KV copied or recomputed, mover.py) and the waiting request
opens in its slot."""

from __future__ import annotations

import asyncio

from scheduler.dispatch import Dispatcher
from scheduler.fleet import RunnerSlot
from scheduler.mover import Mover
from scheduler.policy.placement import ACTIVE, room_without
from scheduler.stream import ClusterStream


class SlotSharing:
    def __init__(self, dispatch: Dispatcher, mover: Mover) -> None:
        self.dispatch, self.mover = dispatch, mover

    def rebalance(self) -> None:
        """Requests wait and no runner has room: while a tenant below its share of the batch
        slots waits and another holds more than its share, that tenant's newest request
        moves back to the queue and the waiting one takes its slot (FairQueue.rebalance).
        Requests giving their slot up no longer count as running, so rounds may overlap."""
        queue = self.dispatch.queue
        snaps = [s for s in self.dispatch.snapshots() if s.state == ACTIVE]
        moves = queue.rebalance(sum(s.max_working_set or s.max_batch_size for s in snaps))
        chosen: set[str] = set()
        takers: dict[str, list[ClusterStream]] = {}
        for move in moves:
            waiting = takers.setdefault(move.taker, queue.waiting_of(move.taker))
            if not waiting:
                continue
            victim = self.victim(move.giver, waiting[0], chosen)
            if victim is None:
                continue
            chosen.add(victim.request_id)
            taker = waiting.pop(0)
            queue.remove(taker)
            victim.slot.streams[taker.request_id] = taker  # its slot, held for the taker
            victim.yielding = True
            self.dispatch.spawn(self._yield_slot(victim, taker, victim.slot))

    def victim(self, tenant: str, taker: ClusterStream, chosen: set[str]) -> ClusterStream | None:
        """The newest running request of `tenant` (not already chosen) whose runner, without
        it (and without those already giving their slots up there), has room for `taker`."""
        key = self.dispatch.queue.key
        candidates = [
            st
            for s in self.dispatch.fleet.active()
            for st in s.streams.values()
            if key(st) == tenant
            and st.inner is not None
            and st.request_id not in chosen
            and not (st.moving or st.closed or st.suspect or st.yielding)
        ]
        for st in sorted(candidates, key=lambda st: st.arrival, reverse=True):
            leaving = [st, *(o for o in st.slot.streams.values() if o.yielding)]
            tokens = [o.num_tokens for o in leaving]
            if room_without(st.slot.snapshot(), tokens, taker.demand()):
                return st
        return None

    async def _yield_slot(
        self, victim: ClusterStream, taker: ClusterStream, slot: RunnerSlot
    ) -> None:
        """Move `victim` back to the queue and open `taker` in its slot (held for it). Both
        are sent at once: on a thread runner the take and the open run between the same
        two steps (the batcher holds the taker until the victim is gone)."""
        try:
            await asyncio.gather(
                self.mover.migrate(victim, "fair_share", requeue=True),
                self.dispatch.attach(taker, slot),
            )
        finally:
            victim.yielding = False
            self.dispatch.kick()
