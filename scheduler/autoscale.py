"""`--autoscale MIN:MAX`: act on the scheduler's advice (scheduler/placement.advise).

Every `interval` seconds: dead runners are forgotten and replaced while fewer than MIN are
active or starting (the scheduler replaces a dead runner itself, by default: its replacement
is starting, so it counts, and no second one is started for it); `scale_up` (requests wait
and every runner is full) starts one runner while fewer than MAX exist; `scale_down` drains
the runner the advice names (idle for the scheduler's idle_after while the others have room,
or the least loaded of more busy runners than ceil(working set / batch) + 1) while more than
MIN are active. One start or idle drain a tick (a runner that is starting counts as capacity
already on its way: no scale_up while one starts, since the requests that wait may be
waiting for it); consolidation drains are repeated within the tick while the advice still
asks for one, so runners in use follow demand that falls faster than a runner a tick. With
the ray backend, new runners are Ray actors, so a Ray cluster autoscaler can add nodes for
them."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from scheduler.cluster import ClusterError, Scheduler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoscaleConfig:
    min_runners: int
    max_runners: int
    interval: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_runners <= self.max_runners:
            raise ValueError(
                f"autoscale wants 1 <= MIN <= MAX, got {self.min_runners}:{self.max_runners}"
            )

    @classmethod
    def parse(cls, text: str) -> AutoscaleConfig:
        lo, sep, hi = text.partition(":")
        if not sep or not lo.isdigit() or not hi.isdigit():
            raise ValueError(f"--autoscale wants MIN:MAX (e.g. 1:4), got {text!r}")
        return cls(int(lo), int(hi))


class Autoscaler:
    def __init__(self, scheduler: Scheduler, config: AutoscaleConfig) -> None:
        self.scheduler = scheduler
        self.config = config
        self.actions: list[str] = []  # what it did, for logs and tests

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep scaling after a failed start or drain
                log.exception("autoscale step failed")
            await asyncio.sleep(self.config.interval)

    async def tick(self) -> None:
        s, cfg = self.scheduler, self.config
        s.check_runners()
        for slot in [x for x in s.slots if x.state == "dead"]:
            await s.drain(slot.runner_id)  # forget it (its requests already moved)
        live = [x for x in s.slots if x.state in ("active", "starting")]
        if len(live) < cfg.min_runners:
            await self._add(cfg.min_runners - len(live), "below the minimum")
            return
        advice = s.advice()
        starting = any(x.state == "starting" for x in live)
        if advice.action == "scale_up" and len(live) < cfg.max_runners and not starting:
            await self._add(1, advice.reason)
        elif advice.action == "scale_down":
            await self._drain(advice, len(live))

    async def _drain(self, advice, live: int) -> None:
        """Drain the advised runner, then ask again (at most once per live runner) and go on
        while the advice is a consolidation (an idle runner is drained one a tick)."""
        s, cfg = self.scheduler, self.config
        for i in range(live):
            if advice.action != "scale_down" or live <= cfg.min_runners:
                return
            if i and not advice.consolidate:
                return
            try:
                await s.drain(advice.runner_id)
            except ClusterError as exc:
                log.info("autoscale: not draining %s: %s", advice.runner_id, exc)
                return
            live -= 1
            self.actions.append(f"drain {advice.runner_id}")
            log.info("autoscale: drained %s (%s)", advice.runner_id, advice.reason)
            advice = s.advice()

    async def _add(self, count: int, why: str) -> None:
        added = await self.scheduler.add_runners(count)
        self.actions.append(f"add {','.join(added)}")
        log.info("autoscale: started %s (%s)", ", ".join(added), why)
