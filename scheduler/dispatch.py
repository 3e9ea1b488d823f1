"""Between the waiting queue and the runners: where a request goes (policy/placement.py over the
runners' snapshots), opening it there, and placing what waits whenever room may have
appeared (`kick`).

The queue is ordered by fair share (waiting.py); a request that finds no runner with room
waits there. A suspect (a request that was in a failed step) goes only to a runner holding
no other suspect, so a step that fails again names one suspect. With DistKV on, a request
that fits on no runner alone is placed on the runner with the most room, and borrows the
rest (place_distributed)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from punica_x.api import RunnerLost
from scheduler.fleet import Fleet, RunnerSlot
from scheduler.policy.placement import ACTIVE, RunnerSnapshot, fits_alone, place, place_distributed
from scheduler.prefix_index import PrefixTracker
from scheduler.stream import ClusterStream
from scheduler.waiting import WaitingQueue

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DispatchEvents:
    """What the dispatcher tells the parts that act on it (wired in Scheduler.__init__).
    preempted(stream): a runner sent `stream` back to its own queue (out of KV): the mover
    takes it. full(): requests wait and no runner has room: fair share may take a slot."""

    preempted: Callable[[ClusterStream], None]
    full: Callable[[], None]


NO_EVENTS = DispatchEvents(preempted=lambda stream: None, full=lambda: None)


class Dispatcher:
    """fleet, queue: the scheduler's. distributed: DistKV placement is allowed.
    version_of(adapter key): the version registered under it (cache-aware placement).
    events: see DispatchEvents; `connect` sets them once the parts that handle them exist
    (they are built over this dispatcher)."""

    def __init__(
        self,
        fleet: Fleet,
        queue: WaitingQueue,
        distributed: bool,
        version_of: Callable[[str], int | None] = lambda adapter: None,
    ) -> None:
        self.fleet, self.queue, self.distributed = fleet, queue, distributed
        self.events = NO_EVENTS
        self.prefix = PrefixTracker(version_of)  # cache-aware placement
        self._tasks: set[asyncio.Task] = set()

    def connect(self, events: DispatchEvents) -> None:
        self.events = events

    def spawn(self, coro) -> None:
        """Run `coro` on the event loop, held here until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def snapshots(self) -> list[RunnerSnapshot]:
        return [s.snapshot() for s in self.fleet.slots]

    def place(
        self, stream: ClusterStream, exclude: frozenset[str] = frozenset(), isolate: bool = True
    ) -> RunnerSlot | None:
        """The runner to open `stream` on, or None. isolate: a suspect (a request that was in
        a failed step) goes only to a runner holding no other suspect."""
        if isolate and stream.suspect:
            exclude = exclude | self._holding_suspects(stream)
        snaps = self.snapshots()
        cached = self.prefix.cached(stream, self.fleet.slots)
        demand = dataclasses.replace(stream.demand(), cached=cached)
        rid = place(snaps, demand, exclude)
        if rid is None and self.distributed:
            active = [s for s in snaps if s.state == ACTIVE and s.runner_id not in exclude]
            if active and not any(fits_alone(s, demand) for s in active):
                rid = place_distributed(snaps, demand, exclude)
        return None if rid is None else self.fleet.slot(rid)

    def _holding_suspects(self, stream: ClusterStream) -> frozenset[str]:
        """Runners that hold a suspect other than `stream` (see ClusterStream.suspect)."""
        return frozenset(
            s.runner_id
            for s in self.fleet.slots
            if any(o.suspect and o is not stream for o in s.streams.values())
        )

    async def attach(self, stream: ClusterStream, slot: RunnerSlot, initial: bool = False) -> None:
        """Open `stream` on `slot`. initial: the caller's open() (refusals raise to it);
        otherwise failures end the stream with an error output or move it on."""
        slot.streams[stream.request_id] = stream  # counted by placement from now on
        stream.slot = slot
        stream.runners_seen.append(slot.runner_id)
        try:
            inner = await slot.handle.open(
                stream.request.resumed(stream.resume), lambda: self.events.preempted(stream)
            )
        except RunnerLost as exc:
            self._unplace(stream, slot)
            self.fleet.died(slot, str(exc))
            if not initial:
                return self.requeue(stream)
            target = self.place(stream)
            if target is None:
                self.queue.push(stream)
                return
            return await self.attach(stream, target, initial=True)
        except BaseException as exc:
            self._unplace(stream, slot)
            if initial:
                raise
            if stream.resume is not None and stream.resume.kv is not None:
                log.warning("%s: KV copy refused (%s); it recomputes", stream.request_id, exc)
                stream.resume = dataclasses.replace(stream.resume, kv=None)
                return self.requeue(stream)  # what a copy cannot do, recomputing does
            stream.fail(f"the request could not be placed again: {exc}")
            self.kick()
            return
        if stream.closed:  # the caller left while it was being placed
            await inner.aclose()
            slot.streams.pop(stream.request_id, None)
            self.kick()
            return
        self._opened(stream, inner)

    @staticmethod
    def _unplace(stream: ClusterStream, slot: RunnerSlot) -> None:
        slot.streams.pop(stream.request_id, None)
        stream.slot = None

    def _opened(self, stream: ClusterStream, inner) -> None:
        stream.inner = inner
        self.prefix.placed(stream, stream.slot)
        if stream.queue_wait is None:  # its first placement: the prompt is served now
            stream.queue_wait = time.monotonic() - stream.created
            self.queue.served(stream, prompt_tokens=len(stream.prompt))
        if stream.resume is not None and stream.resume.kv is not None:
            stream.resume = dataclasses.replace(stream.resume, kv=None)  # imported: let it go
        stream.on_runner.set()

    def requeue(self, stream: ClusterStream) -> None:
        """Place a moving stream now if a runner has room, else queue it (ahead of new ones:
        it was admitted first)."""
        if stream.closed:
            return
        if not self.fleet.active() and not self.fleet.starting():
            stream.fail(self.fleet.no_runner_message())
            return
        target = self.place(stream)
        if target is None:
            self.queue.push(stream, front=True)
        else:
            self.spawn(self.attach(stream, target))

    def kick(self) -> None:
        """Place waiting requests while runners have room, in the fair order (the least
        served tenant's oldest first; with fair share off, the oldest). A suspect that only
        waits for a runner without another suspect keeps its place but lets others by. When
        the next request finds no room, a tenant below its share may take a slot."""
        held: list[ClusterStream] = []
        self.queue.sync_running(self.running())
        while (stream := self.queue.peek()) is not None:
            if stream.closed:
                self.queue.pop(stream)
                continue
            target = self.place(stream)
            if target is None:
                if stream.suspect and self.place(stream, isolate=False) is not None:
                    self.queue.pop(stream)
                    held.append(stream)
                    continue
                self.events.full()
                break
            self.queue.pop(stream)
            target.streams[stream.request_id] = stream  # count it before the open completes
            self.queue.fair.started(self.queue.key(stream))
            self.spawn(self.attach(stream, target))
        for stream in reversed(held):
            self.queue.push(stream, front=True)

    def running(self) -> list[ClusterStream]:
        """Requests on live runners, less those giving their slot up (fair share)."""
        return [
            st
            for s in self.fleet.slots
            if s.state != "dead"
            for st in s.streams.values()
            if not st.yielding
        ]

    def left(self, stream: ClusterStream) -> None:
        """`stream` left its runner (it ended or moved): its place there is free."""
        slot = stream.slot
        if slot is not None:
            self.prefix.left(stream, slot)
            slot.streams.pop(stream.request_id, None)
            if not slot.streams:
                slot.idle_since = time.monotonic()
