"""What crosses the process boundary from a Ray runner to the scheduler, typed: the events
of one poll reply (an output, a preemption notice, a lost request), each numbered by the
actor so that a reply lost on the way is sent again and delivered once, and the Snapshot of
the runner each reply carries."""

from __future__ import annotations

from dataclasses import dataclass

from punica_x.api import EngineStats, RequestOutput


@dataclass(frozen=True)
class OutputEvent:
    """A step's output for the request (deltas; see punica_x.core.RequestOutput)."""

    seq: int
    request_id: str
    output: RequestOutput

    def __reduce__(self):  # its constructor's arguments (see RequestOutput.__reduce__)
        return (OutputEvent, (self.seq, self.request_id, self.output))


@dataclass(frozen=True)
class PreemptEvent:
    """The runner ran out of KV and sent the request back to its own queue."""

    seq: int
    request_id: str


@dataclass(frozen=True)
class LostEvent:
    """The runner's engine stopped (a step raised): the request continues elsewhere.
    in_failed_step: it was in the step that raised (the scheduler's poison quarantine)."""

    seq: int
    request_id: str
    error: str
    in_failed_step: bool


Event = OutputEvent | PreemptEvent | LostEvent


@dataclass(frozen=True)
class Snapshot:
    """What a poll reply carries besides the events: the runner's stats, the adapters
    resident on its device and the adapter versions it still holds."""

    stats: EngineStats
    resident: frozenset[str]
    versions: frozenset[int]
