"""Moving requests between runners (Punica sec. 5.3): under KV pressure, off a draining
runner, off a dead one, and for fair share.

A move takes the request on its runner (its outputs so far stay ahead of the move in its
stream), then places it elsewhere or queues it. The target either recomputes (prefills
prompt + generated tokens, see punica_x.core.Resume) or imports the KV copied along
(policy/migration.py's cost model picks). Either way the client's stream continues with no token
missing or repeated, and greedy and seeded output equal a run that never moved.

A request whose runner died continues from what the client was sent: it recomputes, or,
when the runner was a Lamina model worker whose attention workers live on, it takes its KV
from them (failure, copy: scheduler/lamina/rescue.py). Poison requests: one
that was in QUARANTINE_STEPS failed steps in a row (no token in between) ends with an error
and is never moved again; one whose runners failed under it MAX_FAILURES times ends too."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging

from punica_x.api import RunnerLost
from scheduler.dispatch import Dispatcher
from scheduler.fleet import Fleet, RunnerSlot
from scheduler.policy.migration import COPY, DEFAULT_COSTS, RECOMPUTE, MigrationCosts, choose_mode
from scheduler.policy.placement import ACTIVE, fits_alone, place
from scheduler.stream import ClusterStream

log = logging.getLogger(__name__)

MAX_FAILURES = 3  # runners a request may see fail under it before it ends with an error
QUARANTINE_STEPS = 2  # failed steps in a row a request may be in before it ends with an error
REASONS = ("kv_pressure", "drain", "failure", "fair_share")


class Mover:
    """Moves requests for the scheduler; counts them by (reason, mode) in `migrations`."""

    def __init__(self, fleet: Fleet, dispatch: Dispatcher) -> None:
        self.fleet, self.dispatch = fleet, dispatch
        self.migrations: collections.Counter[tuple[str, str]] = collections.Counter(
            {(reason, mode): 0 for reason in REASONS for mode in (RECOMPUTE, COPY)}
        )
        self.costs: dict[str, MigrationCosts] = dict(DEFAULT_COSTS)  # per backend
        self.quarantined = 0  # requests ended as poison (in QUARANTINE_STEPS failed steps)

    def preempted(self, stream: ClusterStream) -> None:
        """Its runner ran out of KV and sent it back to its own queue: move it to a runner
        with room, if there is one (else it recomputes where it is, as soon as room frees)."""
        source = stream.slot
        if source is None or stream.closed or stream.moving:
            return
        snaps = self.dispatch.snapshots()
        if not any(fits_alone(s, stream.demand()) for s in snaps if s.state == ACTIVE):
            return  # a DistKV request: no runner holds it alone, moving it gains nothing
        target = self.dispatch.place(stream, exclude=frozenset({source.runner_id}))
        if target is not None:
            self.dispatch.spawn(self.migrate(stream, "kv_pressure", target))

    def choose_mode(self, stream: ClusterStream, reason: str) -> str:
        info = stream.slot.handle.info
        costs = self.costs[stream.slot.backend]
        return choose_mode(stream.num_tokens - 1, info.kv_bytes_per_token, costs, reason)

    async def migrate(
        self,
        stream: ClusterStream,
        reason: str,
        target: RunnerSlot | None = None,
        mode: str | None = None,
        requeue: bool = False,
    ) -> bool:
        """Move a request off its runner: take it there, then place it elsewhere (target, if
        it still has room) or queue it (requeue: always queue it, first of its tenant).
        mode: RECOMPUTE or COPY (its KV goes along); None lets the cost model choose
        (scheduler/policy/migration.py). False if it finished or left first."""
        source = stream.slot
        if source is None or stream.closed or stream.moving or stream.inner is None:
            return False
        mode = mode or self.choose_mode(stream, reason)
        stream.moving = True
        try:
            try:
                resume = await source.handle.take(stream.request_id, mode == COPY)
            except RunnerLost:
                return False  # the reader sees RunnerLost and recomputes from what it had
            if resume is None:
                return False  # finished (or aborted) on the source meanwhile
            self._detach(stream, resume, reason)
            if requeue:
                self.dispatch.queue.push(stream, front=True)
                return True
            await self._reopen(stream, source, target)
            return True
        finally:
            stream.moving = False
            self.dispatch.kick()

    def _detach(self, stream: ClusterStream, resume, reason: str) -> None:
        """`stream` was taken off its runner: its next runner resumes from `resume`."""
        source = stream.slot
        self.dispatch.left(stream)
        inner, stream.inner, stream.slot = stream.inner, None, None
        stream.on_runner.clear()
        stream.resume = resume
        inner.moved()
        stream.retired.append(inner)  # read to its end before the new runner's outputs
        mode = COPY if resume.kv is not None else RECOMPUTE
        self.migrations[(reason, mode)] += 1
        log.info(
            "moving %s off %s (%s, %s, %d tokens)",
            stream.request_id,
            source.runner_id,
            reason,
            mode,
            stream.num_tokens,
        )

    async def _reopen(
        self, stream: ClusterStream, source: RunnerSlot, target: RunnerSlot | None
    ) -> None:
        exclude = frozenset({source.runner_id})
        snap = None if target is None or target.state != ACTIVE else target.snapshot()
        if snap is not None and place([snap], stream.demand(), exclude) is None:
            target = None
        target = target or self.dispatch.place(stream, exclude)
        if target is None:
            self.dispatch.requeue(stream)
        else:
            await self.dispatch.attach(stream, target)

    def lost(self, stream: ClusterStream, error: str, in_failed_step: bool = False) -> None:
        """The stream's runner died: continue from what the client was sent. in_failed_step:
        the request was in the step that raised; a request in QUARANTINE_STEPS failed steps
        in a row ends with an error (a poison request is not retried for ever, nor allowed
        to take runner after runner down)."""
        slot = stream.slot
        if slot is not None:
            slot.streams.pop(stream.request_id, None)
            self.fleet.died(slot, error)
        stream.slot, stream.inner = None, None
        stream.on_runner.clear()
        stream.failures += 1
        if in_failed_step:
            stream.failed_steps += 1
            if stream.failed_steps >= QUARANTINE_STEPS:
                self.quarantined += 1
                log.error("request %s quarantined: %s", stream.request_id, error)
                stream.fail(
                    f"this request was in {stream.failed_steps} engine steps that failed "
                    f"(last: {error}); it is not retried",
                    retryable=False,
                )
                self.dispatch.kick()
                return
        if stream.failures >= MAX_FAILURES:
            stream.fail(f"the request failed on {stream.failures} runners; last: {error}")
            return
        stream.resume = stream.resume_point()
        if slot is not None and slot.rescue is not None and _may_take_kv(stream):
            slot.rescuing += 1
            _background(self._rescued(stream, slot))
            return
        self.migrations[("failure", RECOMPUTE)] += 1
        self.dispatch.requeue(stream)
        self.dispatch.kick()
        if slot is not None:
            _let_workers_go(slot)

    async def _rescued(self, stream: ClusterStream, slot: RunnerSlot) -> None:
        """Requeue a dead runner's stream with its KV from the runner's attention workers
        (all its tokens but the last one the client was sent), or to recompute without.
        The last of the runner's streams to be rescued lets its attention workers go."""
        resume = stream.resume
        n = len(stream.prompt) + len(resume.output_token_ids) - 1
        try:
            kv = await asyncio.to_thread(slot.rescue.rescue_kv, stream.request_id, n)
        except Exception as exc:  # the data plane's own failures give None; anything else
            log.warning("rescuing %s's KV failed: %s", stream.request_id, exc)
            kv = None
        slot.rescuing -= 1
        _let_workers_go(slot)
        if kv is not None and stream.resume is resume:
            stream.resume = dataclasses.replace(resume, kv=kv)
        self.migrations[("failure", COPY if kv is not None else RECOMPUTE)] += 1
        self.dispatch.requeue(stream)
        self.dispatch.kick()

    async def drain(self, slot: RunnerSlot, mode: str | None) -> None:
        """Move every request off `slot` (a draining runner: nothing new is placed there)."""
        while slot.streams:
            for stream in list(slot.streams.values()):
                if stream.inner is not None and not stream.moving:
                    await self.migrate(stream, "drain", mode=mode)
            await asyncio.sleep(0.01)  # requests still being opened there, or finishing


def _let_workers_go(slot: RunnerSlot) -> None:
    """Once none of a dead runner's streams is left to rescue, stop its attention workers
    (on a worker thread: Ray calls)."""
    if slot.rescue is not None and not slot.rescuing and not slot.streams:
        handle, slot.rescue = slot.rescue, None
        _background(asyncio.to_thread(handle.release_lamina))


_TASKS: set[asyncio.Task] = set()  # running background tasks (the loop keeps weak references)


def _background(coro) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


def _may_take_kv(stream: ClusterStream) -> bool:
    """A stream can continue from a KV copy: it has streamed tokens (before the first one its
    prompt's KV may be incomplete) and needs no prompt logprobs it has not got."""
    resume = stream.resume
    if resume is None or not resume.output_token_ids or stream.closed:
        return False
    wants = stream.sampling.prompt_logprobs is not None
    return not wants or len(resume.prompt_logprobs or ()) == len(stream.prompt)
