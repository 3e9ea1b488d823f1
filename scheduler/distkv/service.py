"""The scheduler's side of DistKV: the runners' KV group (group.py: thread or Ray), who is
in it, and DGFM's loop that swaps debt cycles home (dgfm.py) while requests run."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from scheduler.distkv.dgfm import Swap
from scheduler.distkv.group import KVGroup, make_kv_group

log = logging.getLogger(__name__)

DGFM_INTERVAL_S = 1.0  # how often the scheduler looks for debt cycles to swap home
DGFM_MIN_SWAP = 4  # blocks: smaller swaps are not worth pausing the runners


def make_distkv(
    backends: set[str], lend_fraction: float, overlap: bool, transport: str
) -> DistKV | None:
    """DistKV for runners of `backends` (one KV group spans one backend; None when they mix).
    lend_fraction, overlap, transport: see Scheduler."""
    group = make_kv_group(backends, lend_fraction, overlap, transport)
    return None if group is None else DistKV(group)


class DistKV:
    """The runners' KV group; `swapped_blocks`: blocks DGFM brought home so far."""

    def __init__(self, group: KVGroup) -> None:
        self.group = group
        self.swapped_blocks = 0
        self._loop_started = False

    def join(self, handle) -> None:
        """Blocking: the runner lends blocks and may borrow them (before it takes work)."""
        self.group.join(handle)

    def leave(self, runner_id: str, dead: bool) -> None:
        """The runner leaves (dead: the blocks it lent are gone; their debtors recompute)."""
        self.group.leave(runner_id, dead)

    async def defragment(
        self, live: dict[str, object], min_swap: int = DGFM_MIN_SWAP
    ) -> list[Swap]:
        """DGFM: swap the debt cycles of at least min_swap blocks home among the `live`
        runners (id -> handle), each cycle's runners held between two steps. Returns the
        swaps done."""
        done = await self.group.defragment(live, min_swap)
        for s in done:
            self.swapped_blocks += s.blocks * len(s.cycle)
            log.info("DGFM: %d blocks of each of %s came home", s.blocks, " -> ".join(s.cycle))
        return done

    def start(self, spawn: Callable, live: Callable[[], dict], closed: Callable[[], bool]) -> None:
        """Start DGFM's loop once, on the running event loop (through `spawn`): every
        DGFM_INTERVAL_S, swap home among live() until closed()."""
        if not self._loop_started:
            self._loop_started = True
            spawn(self._loop(live, closed))

    async def _loop(self, live: Callable[[], dict], closed: Callable[[], bool]) -> None:
        while not closed():
            await asyncio.sleep(DGFM_INTERVAL_S)
            try:
                if self.group.has_work():
                    await self.defragment(live())
            except Exception:
                log.exception("DGFM swap failed")

    def shutdown(self) -> None:
        self.group.shutdown()


def holdable_runners(slots: Iterable) -> dict[str, object]:
    """The runners DGFM may hold: active or draining (id -> handle)."""
    return {s.runner_id: s.handle for s in slots if s.state in ("active", "draining")}
