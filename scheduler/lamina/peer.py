"""What the two kinds of out-of-process attention workers share (launcher.py: a process
each; ray_workers.py: a Ray actor each): the model worker's side of one worker, a KVChannel
that a restart replaces, and the launcher that the engine calls with the workers' specs."""

from __future__ import annotations

import platform
import secrets

from punica_x.api import PeerLost, WorkerRef, WorkerSpec
from scheduler.distkv.channel import ChannelAddress, KVChannel, PreparedPlan
from scheduler.lamina.rescue import LaminaWorkers, WorkerAt


class ChannelPeer:
    """One attention worker as its model worker's peer: prepare / read_blocks / write_blocks
    go over its KVChannel; restart() replaces the worker (a fresh one, empty KV) when the
    old one died. Subclasses start it (_launch: its channel address) and end it (_halt)."""

    def __init__(self, spec: WorkerSpec, launcher: Launcher) -> None:
        self.spec, self.launcher = spec, launcher
        self.owner = f"attention-{spec.heads.index}"
        self.name = self.owner  # how the scheduler finds it (an actor's name under Ray)
        self.address: ChannelAddress | None = None
        self.channel: KVChannel | None = None
        self.start()

    def _launch(self) -> ChannelAddress:
        raise NotImplementedError

    def _halt(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        ln = self.launcher
        self.address = self._launch()
        self.channel = KVChannel(self.owner, self.address, ln.model_id, platform.node(), ln.authkey)

    def restart(self) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self._halt()
        self.channel = None

    def prepare(self, debtor: str, plan) -> PreparedPlan:
        return self._channel().prepare(debtor, plan)

    def read_blocks(self, ids: list[int]):
        return self._channel().read_blocks(ids)

    def write_blocks(self, ids: list[int], data) -> None:
        self._channel().write_blocks(ids, data)

    def counters(self) -> tuple[int, float]:
        """The worker's (attention calls served, seconds computing them) so far."""
        return self._channel().counters()

    def _channel(self) -> KVChannel:
        if self.channel is None:
            raise PeerLost(self.owner, "the attention worker is stopped")
        return self.channel


class Launcher:
    """An engine's attention_launcher (Engine(attention_launcher=...)): called with the
    workers' specs each time the engine builds its KV (memory planning builds twice), it
    stops the workers of an earlier call and starts one `peer` each. model_id names the model
    worker to them; threads: torch threads per worker; close() stops them all."""

    peer: type[ChannelPeer]

    def __init__(self, model_id: str = "model", threads: int = 1) -> None:
        self.model_id = model_id
        self.threads = threads
        self.authkey = secrets.token_bytes(32)
        self.workers: list[ChannelPeer] = []

    def __call__(self, specs: list[WorkerSpec], device=None) -> list[WorkerRef]:
        self.close()
        self.workers = [self.peer(spec, self) for spec in specs]
        return [WorkerRef(w, w.spec.heads) for w in self.workers]

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []

    def describe(self) -> LaminaWorkers:
        """Where the workers are and their key, for whoever takes over their KV should the
        model worker die (rescue.py)."""
        at = tuple(
            WorkerAt(w.name, w.address, w.spec.heads.lo, w.spec.heads.hi)
            for w in self.workers
            if w.address is not None
        )
        return LaminaWorkers(self.model_id, self.authkey, at)
