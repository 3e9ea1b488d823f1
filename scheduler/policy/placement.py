"""Placement policy (Punica sec. 5.1): which runner takes a request, and what the operator
should do about the cluster's size. Pure functions of snapshots: no runner is started or
asked anything, so tests and the cluster simulator call the very code the server runs.

Consolidation: a request goes to the runner with the LARGEST working set (requests it
holds) that still has batch room (room in its working set: its batch under FCFS, the pool
an MLFQ runner picks batches from) and KV room for it; only when none has room does it wait
at the scheduler, first come first served. Packing work onto few runners keeps the others
idle, so they can be scaled down, and large batches are what the shared backbone is cheap
for. Among runners that already hold work, the one believed to hold the longest cached
prefix of the request's tokens (for its adapter version and cache salt: prefix caching,
scheduler/prefix_index.py) wins: every cached token is a token not prefilled; then one where
the request's adapter is resident (no load, as Ray Serve's multiplexed routing does); then
the largest working set. An idle runner is only picked when no busy one has room, even if it
holds the adapter or the prefix: consolidation comes first, so idle runners can go."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

ACTIVE = "active"
STATES = ("starting", "active", "draining", "dead")


@dataclass(frozen=True)
class RunnerSnapshot:
    """One runner as the scheduler sees it. working_set: requests placed on it and not yet
    finished (running, or waiting in its own batcher). kv_blocks_committed: blocks those
    requests need for the tokens they hold now (+1 each for the next), whether allocated
    yet or not; kv_blocks_total: the runner's pool."""

    runner_id: str
    state: str
    working_set: int
    max_batch_size: int
    kv_blocks_total: int
    kv_blocks_committed: int
    block_size: int
    resident_adapters: frozenset[str] = frozenset()
    index: int = 0  # order of creation: the tie-break, so placement is deterministic
    # requests it takes at once (None: max_batch_size; an MLFQ runner takes more, to pick
    # its batches from)
    max_working_set: int | None = None
    # an MLFQ runner's host pool (blocks): the KV of paused requests waits there, so the
    # requests it takes may commit that much more than its device pool
    kv_blocks_swap: int = 0

    @property
    def kv_blocks_room(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_committed


@dataclass(frozen=True)
class Demand:
    """A request to place: its adapter (None: the base model) and the tokens it holds (prompt
    plus, for a migrated request, those generated so far). cached: per runner id, how many of
    its tokens that runner is believed to hold in its prefix cache (absent: none)."""

    adapter: str | None
    num_tokens: int
    cached: Mapping[str, int] = field(default_factory=dict)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks a request holding num_tokens needs to compute its next token."""
    return -(-(num_tokens + 1) // block_size)


def has_room(r: RunnerSnapshot, demand: Demand) -> bool:
    """Active, below its working set, and its device pool plus its host pool (MLFQ) can hold
    the request besides those it has (and the device pool alone could: it runs there).
    Without the host pool, a KV-bound MLFQ runner would be fed in arrival order by the
    scheduler's queue, undoing the runner's own order."""
    need = blocks_for(demand.num_tokens, r.block_size)
    return (
        r.state == ACTIVE
        and r.working_set < (r.max_working_set or r.max_batch_size)
        and r.kv_blocks_room + r.kv_blocks_swap >= need
        and need <= r.kv_blocks_total
    )


def room_without(r: RunnerSnapshot, leaving: Sequence[int], demand: Demand) -> bool:
    """Whether `r` has room for `demand` once requests of `leaving` token counts left it
    (fair share: a slot given up for a waiting request). Each frees at most the runner's
    blocks (a DistKV request holds no more than that here)."""
    freed = sum(min(blocks_for(n, r.block_size), r.kv_blocks_total) for n in leaving)
    after = dataclasses.replace(
        r,
        working_set=r.working_set - len(leaving),
        kv_blocks_committed=r.kv_blocks_committed - freed,
    )
    return has_room(after, demand)


def place(
    runners: Sequence[RunnerSnapshot], demand: Demand, exclude: frozenset[str] = frozenset()
) -> str | None:
    """The runner id to take `demand`, or None when no active runner has room (the request
    waits at the scheduler). `exclude`: runners not to use (the source of a migration)."""
    fits = [r for r in runners if r.runner_id not in exclude and has_room(r, demand)]
    if not fits:
        return None

    def key(r: RunnerSnapshot):
        resident = demand.adapter is None or demand.adapter in r.resident_adapters
        cached = demand.cached.get(r.runner_id, 0)
        return (r.working_set > 0, cached, resident, r.working_set, -r.index)

    return max(fits, key=key).runner_id


def place_distributed(
    runners: Sequence[RunnerSnapshot], demand: Demand, exclude: frozenset[str] = frozenset()
) -> str | None:
    """For a request no single runner can hold (DistKV): the active runner with batch room
    and the most free KV blocks, when the active runners' free blocks together hold it (it
    borrows the rest from the others); None: it waits."""
    active = [r for r in runners if r.state == ACTIVE and r.runner_id not in exclude]
    room = [r for r in active if r.working_set < (r.max_working_set or r.max_batch_size)]
    if not room:
        return None
    need = max(blocks_for(demand.num_tokens, r.block_size) for r in active)
    if sum(max(0, r.kv_blocks_room) for r in active) < need:
        return None
    return max(room, key=lambda r: (r.kv_blocks_room, -r.index)).runner_id


def fits_alone(r: RunnerSnapshot, demand: Demand) -> bool:
    """Whether `demand` could ever run on r (an empty r has room for it)."""
    return blocks_for(demand.num_tokens, r.block_size) <= r.kv_blocks_total


@dataclass(frozen=True)
class Advice:
    action: str  # "scale_up" | "scale_down" | "none"
    runner_id: str | None = None  # for scale_down: the runner to drain
    reason: str = ""
    # scale_down because more runners hold requests than the work needs: the autoscaler asks
    # again after draining it, so demand that falls fast is followed within one tick
    consolidate: bool = False


def advise(
    runners: Sequence[RunnerSnapshot],
    queued: int,
    idle_seconds: dict[str, float],
    idle_after: float = 60.0,
) -> Advice:
    """scale_up when requests wait at the scheduler because every active runner is full;
    scale_down when an active runner has been idle for idle_after seconds while the others
    have room for its share (it is named: the least loaded, newest first), or when more
    runners hold requests than the work needs (consolidation_choice names one); else none.
    idle_seconds: per runner id, how long it has held no request (0 when busy)."""
    active = [r for r in runners if r.state == ACTIVE]
    if queued > 0:
        return Advice("scale_up", None, f"{queued} requests wait and every runner is full")
    if len(active) <= 1:
        return Advice("none")
    idle = [
        r for r in active if r.working_set == 0 and idle_seconds.get(r.runner_id, 0) >= idle_after
    ]
    if idle:
        victim = max(idle, key=lambda r: r.index)
        others = [r for r in active if r.runner_id != victim.runner_id]
        if any(r.working_set < r.max_batch_size for r in others):
            return Advice(
                "scale_down", victim.runner_id, f"{victim.runner_id} idle for {idle_after:g}s"
            )
    victim_id = consolidation_choice(runners)
    if victim_id is not None:
        return Advice("scale_down", victim_id, f"the work fits without {victim_id}", True)
    return Advice("none")


def consolidation_choice(runners: Sequence[RunnerSnapshot]) -> str | None:
    """A busy runner to drain because the work fits on fewer (Punica consolidates; requests
    that finish leave runners lightly loaded, and new ones only go to the busiest): when more
    runners hold requests than ceil(working set / batch) + 1, the least loaded of them,
    provided the other active runners have batch room for all of its requests. None
    otherwise. Draining moves its requests, so the cost is one migration each."""
    active = [r for r in runners if r.state == ACTIVE]
    busy = [r for r in active if r.working_set > 0]
    if len(busy) < 2:
        return None
    demand = sum(r.working_set for r in busy)
    batch = max(r.max_batch_size for r in busy)
    if len(busy) <= -(-demand // batch) + 1:
        return None
    victim = min(busy, key=lambda r: (r.working_set, r.kv_blocks_committed, -r.index))
    room = sum(
        max(0, (r.max_working_set or r.max_batch_size) - r.working_set)
        for r in active
        if r.runner_id != victim.runner_id
    )
    return victim.runner_id if room >= victim.working_set else None


def drain_choice(runners: Sequence[RunnerSnapshot]) -> str | None:
    """The runner `admin scale down` drains when none is named: the least loaded active one
    (newest on ties); None when it is the last active runner."""
    active = [r for r in runners if r.state == ACTIVE]
    if len(active) <= 1:
        return None
    return min(active, key=lambda r: (r.working_set, r.kv_blocks_committed, -r.index)).runner_id
