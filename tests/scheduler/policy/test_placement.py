"""Placement policy: consolidation onto the busiest runner with room, adapter residency among
busy runners, KV and batch room, scheduler queueing, advice and the drain choice."""

from __future__ import annotations

from scheduler.policy.placement import (
    Demand,
    RunnerSnapshot,
    advise,
    consolidation_choice,
    drain_choice,
    place,
)


def snap(rid, working=0, kv_used=0, state="active", adapters=(), index=None, total=100, batch=4):
    return RunnerSnapshot(
        runner_id=rid,
        state=state,
        working_set=working,
        max_batch_size=batch,
        kv_blocks_total=total,
        kv_blocks_committed=kv_used,
        block_size=16,
        resident_adapters=frozenset(adapters),
        index=int(rid[-1]) if index is None else index,
    )


SMALL = Demand(None, 30)  # 2 blocks


def test_consolidates_onto_the_largest_working_set_with_room():
    runners = [snap("r0", 1), snap("r1", 3), snap("r2", 2)]
    assert place(runners, SMALL) == "r1"
    full = [snap("r0", 1), snap("r1", 4), snap("r2", 2)]  # r1's batch is full
    assert place(full, SMALL) == "r2"


def test_an_mlfq_runner_takes_a_working_set_beyond_its_batch():
    """Under MLFQ a runner holds more requests than its batch, to pick each batch from (a
    short request can overtake only requests it holds); KV room still bounds it."""
    from dataclasses import replace

    from punica_x.config import BatchConfig

    pool = BatchConfig(max_batch_size=4, policy="mlfq").max_working_set
    assert pool == 16 and BatchConfig(max_batch_size=4).max_working_set == 4
    assert BatchConfig(max_batch_size=4, policy="mlfq", mlfq_working_set=6).max_working_set == 6
    busy = replace(snap("r1", 4), max_working_set=pool)
    assert place([snap("r0", 1), busy], SMALL) == "r1"
    assert place([snap("r0", 1), replace(busy, working_set=16)], SMALL) == "r0"
    assert place([replace(busy, kv_blocks_committed=99)], SMALL) is None


def test_kv_room_counts_blocks_for_the_next_token():
    runners = [snap("r0", 1), snap("r1", 3, kv_used=98)]
    assert place(runners, Demand(None, 31)) == "r1"  # 32 tokens: 2 blocks, 2 left
    assert place(runners, Demand(None, 32)) == "r0"  # 33 tokens need 3


def test_resident_adapter_wins_among_busy_runners_not_over_an_idle_one():
    runners = [snap("r0", 1, adapters={"a"}), snap("r1", 3), snap("r2", 0, adapters={"b"})]
    assert place(runners, Demand("a", 10)) == "r0"  # busy and resident beats busier
    assert place(runners, Demand("b", 10)) == "r1"  # an idle runner stays idle
    assert place(runners, Demand("c", 10)) == "r1"


def test_only_active_runners_and_not_excluded_ones():
    runners = [
        snap("r0", 2, state="draining"),
        snap("r1", 1, state="starting"),
        snap("r2", 3, state="dead"),
        snap("r3", 0),
    ]
    assert place(runners, SMALL) == "r3"
    assert place(runners, SMALL, exclude=frozenset({"r3"})) is None


def test_no_room_anywhere_queues():
    assert place([snap("r0", 4), snap("r1", 1, kv_used=99)], SMALL) is None


def test_ties_go_to_the_oldest_runner():
    assert place([snap("r2", 0), snap("r0", 0), snap("r1", 0)], SMALL) == "r0"


def test_advice():
    busy = [snap("r0", 4), snap("r1", 4)]
    assert advise(busy, queued=3, idle_seconds={}).action == "scale_up"
    mixed = [snap("r0", 2), snap("r1", 0), snap("r2", 0)]
    assert advise(mixed, 0, {"r1": 5.0, "r2": 5.0}, idle_after=60).action == "none"
    a = advise(mixed, 0, {"r1": 61.0, "r2": 61.0}, idle_after=60)
    assert (a.action, a.runner_id) == ("scale_down", "r2")
    assert advise([snap("r0", 0)], 0, {"r0": 1e9}).action == "none"  # never the last one


def test_consolidation_drains_a_busy_runner_the_work_does_not_need():
    """Batch 4: 3 runners holding 1 + 1 + 2 requests need ceil(4 / 4) + 1 = 2, so the least
    loaded (newest on ties) is drained when the others have room for its request."""
    spread = [snap("r0", 2), snap("r1", 1), snap("r2", 1)]
    assert consolidation_choice(spread) == "r2"
    a = advise(spread, 0, {})
    assert (a.action, a.runner_id) == ("scale_down", "r2")
    assert consolidation_choice([snap("r0", 4), snap("r1", 3), snap("r2", 1)]) is None  # 8: 3
    assert consolidation_choice([snap("r0", 2), snap("r1", 1)]) is None  # within the + 1
    draining = [snap("r0", 2), snap("r1", 1, state="draining"), snap("r2", 1)]
    assert consolidation_choice(draining) is None  # a draining runner is already going
    assert advise(draining, 0, {}).action == "none"


def test_drain_choice_is_the_least_loaded_and_never_the_last():
    assert drain_choice([snap("r0", 3), snap("r1", 1), snap("r2", 2)]) == "r1"
    assert drain_choice([snap("r0", 3), snap("r1", 0, state="draining")]) is None


def test_an_mlfq_runner_with_its_kv_committed_still_takes_requests_its_host_pool_holds():
    """The KV of the requests it pauses goes to its host pool: placement counts that pool, so
    the scheduler's arrival-order queue does not decide for a KV-bound MLFQ runner."""
    from dataclasses import replace

    full = replace(snap("r0", 3, kv_used=100), max_working_set=16)
    assert place([full], SMALL) is None  # FCFS: no host pool, waits at the scheduler
    assert place([replace(full, kv_blocks_swap=1)], SMALL) is None  # 0 + 1 < 2 blocks
    assert place([replace(full, kv_blocks_swap=50)], SMALL) == "r0"
    big = Demand(None, 100 * 16)  # more than its device pool: the host pool cannot run it
    assert place([replace(full, kv_blocks_committed=0, kv_blocks_swap=500)], big) is None


def test_the_longest_cached_prefix_wins_among_busy_runners():
    """Prefix caching: among runners with work and room, the one believed to hold the
    most of the request's prefix takes it, before adapter residency and working set; an
    idle runner is still picked only when no busy one has room (consolidation first)."""
    runners = [snap("r0", 3, adapters=("a",)), snap("r1", 1), snap("r2", 0)]
    assert place(runners, Demand("a", 100)) == "r0"  # nothing cached: residency
    assert place(runners, Demand("a", 100, cached={"r1": 32})) == "r1"
    assert place(runners, Demand("a", 100, cached={"r1": 32, "r0": 48})) == "r0"
    assert place(runners, Demand("a", 100, cached={"r2": 96})) == "r0"  # r2 is idle
    full = [snap("r0", 4), snap("r1", 4), snap("r2", 0), snap("r3", 0)]
    assert place(full, Demand(None, 100)) == "r2"  # all busy are full: the oldest idle
    assert place(full, Demand(None, 100, cached={"r3": 16})) == "r3"  # ... or the cached one
