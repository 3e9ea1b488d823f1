"""What the batcher decides for one step (Batcher.schedule / MLFQBatcher.schedule): the rows
that run, and the requests the engine must end or tell about before it runs them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from punica_x.runtime import Request


class ScheduledRequest(NamedTuple):
    """One request's part of a step: num_new_tokens tokens from its num_computed_tokens on
    (a NamedTuple: millions are made a simulated hour, and a frozen dataclass's init is 3x
    slower)."""

    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step computes the request's last known token (so it samples)."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass(frozen=True, slots=True)
class Schedule:
    """One step's schedule.

    rows: the requests that run this step with their new tokens, in the batcher's order (the
        planner groups them by adapter).
    overflow: requests that need more KV than the whole cache holds (or, under DistKV, than
        the cluster lends one request) even running alone: the engine ends them with LENGTH.
    starved: requests that waited for peers' blocks past KVBorrowing.give_up_s: the engine
        ends them with ERROR.
    preempted: requests sent back to waiting (KV freed or swapped out) since the last
        schedule: the engine tells their on_preempt (the scheduler may move them).
    """

    rows: list[ScheduledRequest]
    overflow: list[Request]
    starved: list[Request]
    preempted: list[Request]
