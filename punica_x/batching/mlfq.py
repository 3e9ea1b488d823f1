"""Skip-join multi-level feedback queue (FastServe): who a runner serves first.

Pure policy: functions of per-request `Priority` state and the times given to them (no
clock, no engine), so the runner's MLFQ batcher and the cluster simulator run the same code.

Levels 0..K-1, 0 served first. Level i has a quantum of q_1 * 2**i seconds of iteration
time (quantum ratio 2). q_1 is the minimal iteration (a step computing one token) and K is
the smallest count whose last quantum covers the longest span the policy must tell apart
(the batcher passes the longer of a full token budget's prefill and a long generation's
service), both from the runner's measured step times (`Levels.derive`).

- join: a new request skips the levels whose quantum its first iteration (its prefill) would
  overrun and joins the highest level whose quantum covers it (skip-join);
- charge: every iteration a request runs in charges it that iteration's time; when the
  charges reach its level's quantum it drops one level (the last level keeps it);
- starvation: a request that has not run for `starve_s` seconds goes back to level 0.

Within a level, arrival order (FCFS). With one level MLFQ is FCFS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Levels:
    """q1_s: quantum of level 0 (seconds); count: number of levels; starve_s: how long a
    request may go unserved before it is promoted to level 0."""

    q1_s: float
    count: int
    starve_s: float

    def __post_init__(self) -> None:
        if not self.q1_s > 0 or self.count < 1 or not self.starve_s > 0:
            raise ValueError(f"bad MLFQ levels {self}")

    def quantum(self, level: int) -> float:
        return self.q1_s * 2.0**level

    @classmethod
    def derive(cls, min_step_s: float, max_step_s: float, starve_s: float) -> Levels:
        """q_1 = the minimal iteration; enough levels (at least 2) that the last quantum
        covers the longest iteration."""
        min_step_s = max(min_step_s, 1e-6)
        ratio = max(max_step_s / min_step_s, 1.0)
        return cls(min_step_s, max(2, math.ceil(math.log2(ratio)) + 1), starve_s)


@dataclass
class Priority:
    """One request's place in the queues. arrival: a sequence number (FCFS within a level);
    charged_s: iteration time spent in its current level; last_served_s: when it last ran
    (or joined)."""

    level: int
    arrival: int
    charged_s: float = 0.0
    last_served_s: float = 0.0
    demotions: int = 0
    promotions: int = 0


def join_level(levels: Levels, prefill_s: float) -> int:
    """The highest level whose quantum covers the request's first iteration."""
    for level in range(levels.count):
        if levels.quantum(level) >= prefill_s:
            return level
    return levels.count - 1


def join(levels: Levels, prefill_s: float, arrival: int, now: float) -> Priority:
    return Priority(join_level(levels, prefill_s), arrival, 0.0, now)


def charge(p: Priority, levels: Levels, ran_s: float, now: float) -> None:
    """The request ran in an iteration of ran_s seconds ending at `now`: demote it one level
    when its level's quantum is used up."""
    p.level = min(p.level, levels.count - 1)
    p.charged_s += ran_s
    p.last_served_s = now
    if p.charged_s >= levels.quantum(p.level) and p.level < levels.count - 1:
        p.level += 1
        p.charged_s = 0.0
        p.demotions += 1


def promote_if_starved(p: Priority, levels: Levels, now: float) -> bool:
    """Back to level 0 when it has waited longer than the starvation limit."""
    if p.level > 0 and now - p.last_served_s > levels.starve_s:
        p.level, p.charged_s, p.last_served_s = 0, 0.0, now
        p.promotions += 1
        return True
    return False


def order_key(p: Priority) -> tuple[int, int]:
    """Sort key: higher levels (smaller numbers) first, then arrival."""
    return (p.level, p.arrival)
