"""A dead model worker's KV, taken from its attention workers (Lamina 4.5: a failed model
worker is replaced and its requests go on from their KV, which it never held).

A model worker's plans carry its block tables (MicroPlan.tables) to its attention workers,
which keep the latest (AttentionWorker.block_tables). When the model worker's process dies,
the scheduler still has the workers' addresses and key (LaminaWorkers, from the runner's
start) and, per request, what the client was sent. The KV of every token but the last one
sent is complete on the workers (the step that produced a token wrote its input's K/V in
every layer), so rescue_kv() reads those blocks from every worker, joins the head slices and
returns a KVSnapshot: the runner that continues the request imports it (the live-copy path,
punica_x/engine/moves.py) and recomputes nothing but the last token."""

from __future__ import annotations

import contextlib
import logging
import platform
from dataclasses import dataclass

import torch

from punica_x.api import KVSnapshot, PeerLost
from scheduler.distkv.channel import ChannelAddress, KVChannel

log = logging.getLogger(__name__)

NAMESPACE = "punica-x-lamina"  # the Ray namespace of the attention worker actors (detached)


@dataclass(frozen=True)
class WorkerAt:
    """An attention worker as the scheduler finds it: its actor's name (to stop it), its
    channel address and its KV heads [lo, hi)."""

    name: str
    address: ChannelAddress
    lo: int
    hi: int


@dataclass(frozen=True)
class LaminaWorkers:
    """A model worker's attention workers: its id (as it names itself to them), their key
    and each worker, in head order."""

    model_id: str
    authkey: bytes
    workers: tuple[WorkerAt, ...]

    @property
    def heads(self) -> int:
        """The KV heads the workers hold together (their slices joined from head 0)."""
        end = 0
        for w in sorted(self.workers, key=lambda w: w.lo):
            if w.lo != end:
                break
            end = w.hi
        return end


class KVRescue:
    """Reads a dead model worker's requests' KV off its attention workers. Blocking (socket
    calls): run it on a worker thread. close() when done."""

    def __init__(self, at: LaminaWorkers, block_size: int, heads: int | None = None) -> None:
        """heads: the KV heads a copy must have (None: what the workers hold); workers that
        do not hold them all (one was being replaced when `at` was taken) give no copy."""
        self.at, self.block_size = at, block_size
        self.heads = at.heads if heads is None else heads
        self.channels: list[KVChannel] | None = None
        self.tables: dict[str, tuple[int, ...]] = {}

    def _connect(self) -> list[KVChannel]:
        if self.channels is None:
            node, key = platform.node(), self.at.authkey
            self.channels = []  # so a failure below is not retried for every request
            self.channels = [
                KVChannel(w.name, w.address, f"rescue-{self.at.model_id}", node, key)
                for w in self.at.workers
            ]
            self.tables = self.channels[0].block_tables() if self.channels else {}
        return self.channels

    def kv(self, request_id: str, num_tokens: int) -> KVSnapshot | None:
        """The first num_tokens tokens' KV of request_id ([n, L, 2, N_kv, P, D] on the CPU),
        None when the workers do not hold them all (it was swapped out, or never planned
        there, or a worker is gone too): then the request recomputes."""
        if num_tokens <= 0:
            return None
        try:
            channels = self._connect()
            table = self.tables.get(request_id, ())
            n = -(-num_tokens // self.block_size)
            if not channels or len(table) < n or self.at.heads != self.heads:
                return None
            parts = [c.read_blocks(list(table[:n])) for c in channels]
        except (PeerLost, OSError, EOFError, ValueError) as exc:
            log.warning("no KV of %s from the attention workers: %s", request_id, exc)
            return None
        return KVSnapshot(num_tokens, torch.cat(parts, dim=3) if len(parts) > 1 else parts[0])

    def close(self) -> None:
        for c in self.channels or ():
            c.close()
        self.channels = []


def stop_workers(at: LaminaWorkers) -> None:
    """Stop the attention worker actors of `at` (those still alive)."""
    import ray

    for w in at.workers:
        with contextlib.suppress(ValueError):  # already gone
            ray.kill(ray.get_actor(w.name, namespace=NAMESPACE))
