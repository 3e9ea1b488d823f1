"""RayWorkers: a Ray runner's attention-worker launcher. Each attention worker is a Ray actor
of its own (AttentionActor: an AttentionWorker behind a KVChannelServer), reached over the
DistKV data plane like a process worker (launcher.py), and placed by Ray on any node.

The actors are detached: they do not die with the model worker (the runner actor) that
started them, so when a model worker's process is killed its requests' KV is still there, and
the scheduler takes it to the runner that continues them (rescue.py) instead of recomputing
it. A worker left without a model worker (no connection for ORPHAN_S) exits by itself, so a
killed model worker leaves nothing behind on a long-lived cluster; the model worker's normal
shutdown stops its workers at once."""

from __future__ import annotations

import os
import platform
import threading
import time
import uuid

from punica_x.api import WorkerSpec
from scheduler.distkv.channel import ChannelAddress
from scheduler.lamina.peer import ChannelPeer, Launcher
from scheduler.lamina.rescue import NAMESPACE

ORPHAN_S = float(os.environ.get("PUNICA_X_LAMINA_ORPHAN_S", 60.0))


class AttentionActor:
    """An attention worker in a Ray actor: serves its model worker's frames over a
    KVChannelServer on its node (a Unix socket there, TCP to other nodes) until stopped, or
    until no peer has been connected for orphan_s seconds."""

    def __init__(self, spec: WorkerSpec, authkey: bytes, threads: int, orphan_s: float) -> None:
        import ray
        import torch

        from punica_x.api import AttentionWorker
        from scheduler.distkv.channel import KVChannelServer

        torch.set_num_threads(max(1, threads))
        self.worker = AttentionWorker(spec)
        host = ray.util.get_node_ip_address()
        self.server = KVChannelServer(self.worker, authkey, platform.node(), host)
        self.orphan_s = orphan_s
        threading.Thread(target=self._watch, daemon=True).start()

    def where(self) -> tuple[ChannelAddress, int]:
        """(the address its server listens on, its pid)."""
        return self.server.address, os.getpid()

    def _watch(self) -> None:
        alone_since = time.monotonic()
        while True:
            time.sleep(min(1.0, self.orphan_s / 4))
            if self.server.connections:
                alone_since = time.monotonic()
            elif time.monotonic() - alone_since > self.orphan_s:
                self.server.close()
                os._exit(0)  # no model worker and nobody rescuing its KV: gone


class ActorWorker(ChannelPeer):
    """The model worker's side of one AttentionActor (detached: it outlives the model
    worker's process, see the module doc)."""

    def __init__(self, spec: WorkerSpec, launcher: RayWorkers) -> None:
        self.actor = None
        self.pid = 0
        super().__init__(spec, launcher)

    @property
    def node(self) -> str:
        return self.address.node if self.address is not None else ""

    def _launch(self) -> ChannelAddress:
        import ray

        ln = self.launcher
        self.name = f"punica-x-{ln.model_id}-{self.owner}-{uuid.uuid4().hex[:8]}"
        cls = ray.remote(AttentionActor).options(
            name=self.name,
            namespace=NAMESPACE,
            lifetime="detached",
            num_cpus=0,
            max_concurrency=4,
        )
        self.actor = cls.remote(self.spec, ln.authkey, ln.threads, ln.orphan_s)
        address, self.pid = ray.get(self.actor.where.remote())
        return address

    def _halt(self) -> None:
        import ray

        if self.actor is not None:
            ray.kill(self.actor)
        self.actor = self.address = None


class RayWorkers(Launcher):
    """An engine's attention_launcher whose workers are AttentionActors; model_id names the
    model worker to them, threads: torch threads per worker; a worker alone for orphan_s
    seconds exits."""

    peer = ActorWorker

    def __init__(self, model_id: str, threads: int = 1, orphan_s: float = ORPHAN_S) -> None:
        super().__init__(model_id, threads)
        self.orphan_s = orphan_s


def ray_attention_launcher(config, runner_id: str, threads: int = 1) -> RayWorkers | None:
    """A Ray runner's launcher: RayWorkers when its config asks for attention workers
    (EngineConfig.attention_workers), else None."""
    if not config.attention_workers:
        return None
    return RayWorkers(runner_id, threads)
