"""The scheduler's runners: their slots, starting them, noticing and replacing dead ones, and
the rows the admin API lists.

A RunnerSlot is a runner as the scheduler tracks it: starting (no handle yet), active,
draining or dead. The Fleet starts runners through the factory (scale-up, and replacements
of dead runners under a RestartPolicy: at once the first time, with a growing delay while
replacements keep dying soon after they start), and tells the scheduler what it needs to
know through FleetHooks: a runner is about to take work (every adapter, DistKV), one left
DistKV, room appeared, or no runner is left at all. Moving a dead runner's requests is the
scheduler's part."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from punica_x.api import EngineStats, RequestLimits, UnknownAdapterError, in_side_thread, thaw
from scheduler.errors import ClusterError
from scheduler.policy.placement import ACTIVE, RunnerSnapshot
from scheduler.prefix_index import PrefixIndex
from scheduler.rows import RunnerRow, runner_row
from scheduler.runners.interface import RunnerHandle
from scheduler.stream_table import StreamTable

log = logging.getLogger(__name__)

KEEP_DEAD = 8  # dead runners still listed (GET /admin/runners) before the oldest is dropped


@dataclass(frozen=True)
class RestartPolicy:
    """How a dead runner is replaced (through the scheduler's factory): at once the first
    time; while each replacement dies within stable_s of taking work, the next one starts
    after backoff_s, then twice that, ... up to max_backoff_s; a runner that stayed up
    stable_s is replaced at once again. A replacement whose start fails is tried again
    (with the next delay) up to start_attempts times, then left dead."""

    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_s: float = 60.0
    start_attempts: int = 3

    def delay(self, level: int) -> float:
        """Seconds before a replacement when `level` runners of its line died quickly
        before the one it replaces."""
        if level <= 0:
            return 0.0
        return min(self.max_backoff_s, self.backoff_s * 2 ** (level - 1))


DEFAULT_RESTART = RestartPolicy()


@dataclass(eq=False)
class RunnerSlot:
    """A runner as the scheduler tracks it (handle is None while it starts)."""

    runner_id: str
    index: int
    backend: str
    handle: RunnerHandle | None = None
    state: str = "starting"
    streams: StreamTable = field(default_factory=StreamTable)
    idle_since: float = field(default_factory=time.monotonic)
    error: str | None = None
    active_since: float = field(default_factory=time.monotonic)
    replaces: str | None = None  # the dead runner this one was started in place of
    # runners of its line (each replaced the one before) that died in a row just before it,
    # all but the first within the restart policy's stable_s of taking work (its backoff)
    streak: int = 0
    start_failures: int = 0  # failed starts of this replacement
    replace_due: bool = False  # dead, and to be replaced once an event loop runs
    where: tuple = (None, None, None)  # node, pid, device (kept after the handle is let go)
    prefix: PrefixIndex | None = None  # what it holds in its prefix cache, as we believe
    # dead: its handle, kept after it is let go while its requests' KV is taken off its
    # attention workers (a Lamina model worker's live on: scheduler/lamina/rescue.py), and
    # the rescues running
    rescue: object | None = None
    rescuing: int = 0

    def snapshot(self) -> RunnerSnapshot:
        h = self.handle
        if h is None:
            return RunnerSnapshot(self.runner_id, self.state, 0, 0, 0, 0, 1, index=self.index)
        i = h.info
        committed = self.streams.committed(i.block_size, i.kv_blocks_total) + kv_lent(h)
        return RunnerSnapshot(
            runner_id=self.runner_id,
            state=self.state,
            working_set=len(self.streams),
            max_batch_size=i.max_batch_size,
            max_working_set=i.max_working_set,
            kv_blocks_total=i.kv_blocks_total,
            kv_blocks_committed=committed,
            kv_blocks_swap=i.kv_blocks_swap,
            block_size=i.block_size,
            resident_adapters=h.resident_adapters(),
            index=self.index,
        )


def kv_lent(handle) -> int:
    """Blocks a runner lends to peers' requests (DistKV); 0 when it takes no part."""
    return handle.stats().kv_blocks_lent


class FleetHooks(Protocol):
    """What the Fleet tells the scheduler."""

    async def install(self, handle) -> None:
        """A starting runner gets every current adapter (raises: its start failed)."""

    def join(self, slot: RunnerSlot) -> None:
        """Blocking: the runner joins DistKV, before it takes work."""

    def runner_left(self, slot: RunnerSlot) -> None:
        """The runner died: out of DistKV (what it lent is gone)."""

    def kick(self) -> None:
        """A runner became active: place what waits."""

    def none_left(self, message: str) -> None:
        """No runner is active or starting: end what waits with `message`."""


class Fleet:
    """runners: started runners; factory(runner_id) builds one more of the same backend
    (blocking; a worker thread runs it), None: fixed size; restart: how dead runners are
    replaced (None, or no factory: left dead)."""

    def __init__(
        self,
        runners: list[RunnerHandle],
        factory: Callable[[str], RunnerHandle] | None,
        restart: RestartPolicy | None,
        hooks: FleetHooks,
    ) -> None:
        self.factory, self.restart, self.hooks = factory, restart, hooks
        self.restarts = 0  # dead runners replaced (the replacement took work)
        self.failures: collections.Counter[str] = collections.Counter()  # runner deaths
        # what requests are checked against while no runner is active (one is starting)
        self.limits: RequestLimits = runners[0].limits()
        self.closed = False
        self._index = itertools.count()
        self._replacing: set[asyncio.Task] = set()  # dead runners' replacements starting
        self.slots: list[RunnerSlot] = []
        for r in runners:
            slot = RunnerSlot(r.runner_id, next(self._index), r.backend, r, state=ACTIVE)
            slot.where = _where(r)
            self.slots.append(slot)

    def active(self) -> list[RunnerSlot]:
        return [s for s in self.slots if s.state == ACTIVE]

    def slot(self, runner_id: str) -> RunnerSlot:
        for s in self.slots:
            if s.runner_id == runner_id:
                return s
        raise ClusterError(404, "runner_not_found", f"no runner {runner_id!r}")

    def validate(self, prompt, sampling, adapter: str | None, registered) -> None:
        """The refusals a runner would raise; with no runner active, against the last
        runner's limits and the adapters `registered` (the scheduler's registry)."""
        active = self.active()
        if active:
            active[0].handle.validate(prompt, sampling, adapter)
            return
        self.limits.check(prompt, sampling)
        if adapter is not None and adapter not in registered:
            raise UnknownAdapterError(adapter)

    def stats(self, waiting: int = 0) -> EngineStats:
        """Sums over live runners, `waiting` (requests waiting in front of them) added."""
        return EngineStats.total([h.stats() for h in self.live_handles()], waiting)

    def live_handles(self) -> list:
        return [s.handle for s in self.slots if s.handle is not None and s.state != "dead"]

    def no_runner_message(self) -> str:
        errors = [f"{s.runner_id}: {s.error}" for s in self.slots if s.error]
        return "no runner is left to serve the request" + (f" ({errors[-1]})" if errors else "")

    def starting(self) -> list[RunnerSlot]:
        return [s for s in self.slots if s.state == "starting"]

    def check(self) -> None:
        """Notice runners that died between requests (a thread that exited), and replace
        dead ones that could not be replaced where they died (no event loop there)."""
        for slot in list(self.slots):
            if slot.state in (ACTIVE, "draining") and not slot.handle.alive():
                self.died(slot, slot.handle.error or "the runner stopped")
            elif slot.state == "dead" and slot.replace_due:
                self._replace(slot)

    def died(self, slot: RunnerSlot, error: str) -> None:
        """The runner under `slot` failed: marked dead, out of DistKV, replaced (unless it
        was draining); the oldest dead slots past KEEP_DEAD are dropped from the list."""
        if slot.state == "dead":
            return
        log.error("runner %s failed: %s; its requests continue elsewhere", slot.runner_id, error)
        draining = slot.state == "draining"
        slot.state, slot.error = "dead", error
        if getattr(slot.handle, "lamina", None) is not None:
            slot.rescue = slot.handle  # its attention workers outlive it, with their KV
        self.hooks.runner_left(slot)
        self.failures[slot.runner_id] += 1
        if not draining:  # (a runner being drained was on its way out anyway)
            slot.replace_due = self._can_replace()
            self._replace(slot)
        dead = [s for s in self.slots if s.state == "dead"]
        for old in dead[: max(0, len(dead) - KEEP_DEAD)]:
            self.slots.remove(old)
        self._check_none_left()

    def begin_drain(self, runner_id: str) -> RunnerSlot | None:
        """Stop placing on `runner_id` and lending its blocks; its requests are to be moved.
        None: it was dead, and is dropped from the list. The last active runner, or one
        not active, is refused (409)."""
        slot = self.slot(runner_id)
        if slot.state == "dead":
            self.slots.remove(slot)
            return None
        if slot.state != ACTIVE:
            raise ClusterError(409, "not_active", f"runner {runner_id} is {slot.state}")
        if len(self.active()) <= 1:
            raise ClusterError(409, "last_runner", "the last active runner cannot be removed")
        slot.state = "draining"
        slot.handle.stop_lending()
        log.info("draining runner %s (%d requests)", runner_id, len(slot.streams))
        return slot

    async def stop(self, slot: RunnerSlot) -> None:
        """Stop a drained runner (it holds no request) and drop it from the list."""
        await asyncio.to_thread(slot.handle.shutdown)
        self.slots.remove(slot)
        log.info("runner %s drained and stopped", slot.runner_id)

    def _check_none_left(self) -> None:
        if not self.active() and not self.starting():
            self.hooks.none_left(self.no_runner_message())

    # -- replacing dead runners ---------------------------------------------------------------
    def _can_replace(self) -> bool:
        return self.restart is not None and self.factory is not None and not self.closed

    def _replace(self, dead: RunnerSlot) -> None:
        """Start a runner in the dead one's place (see RestartPolicy), unless no event loop
        runs here (check_runners does it on the next call from one)."""
        if not dead.replace_due:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        dead.replace_due = False
        old, dead.handle = dead.handle, None  # let its engine (and KV cache) go
        if old is not None:
            with contextlib.suppress(Exception):
                self.limits = old.limits()
        quick = time.monotonic() - dead.active_since < self.restart.stable_s
        streak = dead.streak if quick else 0  # quick failures before this one
        index = next(self._index)
        slot = RunnerSlot(f"runner-{index}", index, dead.backend, replaces=dead.runner_id)
        slot.streak = streak + 1
        self.slots.append(slot)
        delay = self.restart.delay(streak)
        log.warning(
            "starting runner %s in place of %s%s",
            slot.runner_id,
            dead.runner_id,
            f" in {delay:g} s" if delay else "",
        )
        task = asyncio.get_running_loop().create_task(self._replacement(slot, old, delay))
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    async def _replacement(self, slot: RunnerSlot, old, delay: float) -> None:
        """Stop the dead runner's handle (its process, its thread's engine), wait `delay`,
        start `slot` as add_runners would (every adapter, DistKV); a failed start is tried
        again after the next delay, up to start_attempts times."""
        try:
            if old is not None:
                box = [old]
                del old  # the worker thread holds the last reference, and drops it
                await asyncio.to_thread(_let_go, box)
            while True:
                if delay > 0:
                    await asyncio.sleep(delay)
                if self.closed or slot not in self.slots:
                    return
                try:
                    await self._start(slot)
                except Exception as exc:  # _start left it dead
                    slot.start_failures += 1
                    log.error("replacement runner %s failed to start: %s", slot.runner_id, exc)
                    if slot.start_failures >= self.restart.start_attempts or self.closed:
                        self._check_none_left()
                        return
                    slot.state = "starting"
                    delay = self.restart.delay(slot.streak + slot.start_failures - 1)
                    continue
                self.restarts += 1
                self.hooks.kick()
                return
        except asyncio.CancelledError:  # its event loop ended: a later one starts it over
            if slot.state != ACTIVE:
                slot.state, slot.error = "dead", "its start was cancelled"
                slot.replace_due = self._can_replace()
            raise

    # -- starting runners ---------------------------------------------------------------------
    async def add(self, count: int) -> list[str]:
        """Start `count` runners; each takes work once loaded and given every adapter."""
        if self.factory is None:
            raise ClusterError(409, "fixed_size", "this server cannot start runners")
        if not 1 <= count <= 16:
            raise ClusterError(400, "invalid_value", "count must be in [1, 16]")
        slots = []
        for _ in range(count):
            index = next(self._index)
            slot = RunnerSlot(f"runner-{index}", index, self.slots[0].backend)
            self.slots.append(slot)
            slots.append(slot)
        results = await asyncio.gather(*(self._start(s) for s in slots), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        self.hooks.kick()
        if errors:
            raise ClusterError(500, "runner_start_failed", f"a runner failed to start: {errors[0]}")
        return [s.runner_id for s in slots]

    async def _start(self, slot: RunnerSlot) -> None:
        try:
            # a runner's build and join run torch ops: threads of their own, which leave no
            # OpenMP threads behind (punica_x.side_thread)
            slot.handle = await in_side_thread(self._build, slot.runner_id)
            slot.backend = slot.handle.backend
            slot.where = _where(slot.handle)
            await self.hooks.install(slot.handle)
        except BaseException as exc:
            slot.state, slot.error = "dead", f"start failed: {exc}"
            if slot.handle is not None:
                await asyncio.to_thread(slot.handle.shutdown)
            raise
        await in_side_thread(self.hooks.join, slot)
        slot.state = ACTIVE
        slot.idle_since = slot.active_since = time.monotonic()
        slot.error = None
        log.info("runner %s is active", slot.runner_id)

    def _build(self, runner_id: str):
        """factory(runner_id), on a worker thread; a runner built after shutdown() is stopped
        at once instead of being left running."""
        handle = self.factory(runner_id)
        if self.closed:
            handle.shutdown()
            raise RuntimeError("the scheduler shut down while the runner started")
        return handle

    def rows(self) -> list[RunnerRow]:
        """What GET /admin/runners lists, one row per runner."""
        self.check()
        return [runner_row(slot) for slot in self.slots]

    def shutdown(self) -> None:
        self.closed = True
        for task in list(self._replacing):  # (a runner its factory builds now is stopped)
            with contextlib.suppress(RuntimeError):  # its loop is closed: nothing runs it
                task.get_loop().call_soon_threadsafe(task.cancel)
        for s in self.slots:
            if s.handle is not None and s.state != "dead":
                s.handle.shutdown()


def _where(handle) -> tuple:
    """(node, pid, device) of a runner, listed after it is let go."""
    return handle.info.node, handle.info.pid, handle.info.device


def _let_go(box: list) -> None:
    """Stop the dead runner's handle in `box` (a Ray actor is killed; a thread runner's
    engine joins its thread), drop it and collect its engine, so its memory is free before a
    replacement loads."""
    handle = box.pop()
    try:
        handle.shutdown()
    except Exception:
        log.exception("stopping dead runner %s failed", getattr(handle, "runner_id", "?"))
    del handle
    thaw("a dead runner let go")  # its engine's objects, frozen at its start, are collected
