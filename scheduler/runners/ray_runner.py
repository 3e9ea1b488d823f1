"""A runner in its own process: an Engine inside a Ray actor, behind the RunnerHandle API.

Messages (all dataclasses, pickled by Ray):
- the scheduler's calls (open, take, abort, adapters) are actor method calls;
- outputs come back in batches: a pump task long-polls the actor, and each reply carries
  every output (and preemption notice) produced since the last one, plus the runner's stats:
  one message per engine step at most, never a remote call per token per request;
- adapters travel as bytes (through Ray's object store), so a runner on another node needs no
  shared filesystem; the actor writes them to a directory of its own and registers them.

A runner whose process dies (SIGKILL, OOM, a lost node) surfaces as RayActorError on the
next poll: every open stream ends with RunnerLost and the scheduler recomputes elsewhere.
A runner whose engine step raised sends a "lost" event per open request, carrying whether
the request was in that step (RunnerLost.in_failed_step: the scheduler's poison-request
quarantine); a process that died cannot tell, so its streams end with in_failed_step False.

The actor is scheduler/runners/ray_actor.py, its events scheduler/runners/ray_events.py. ray
is imported on first use, so the thread backend never pays for it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import uuid
from pathlib import Path

from punica_x.api import AdapterInfo, EngineConfig, EngineStats
from scheduler.runners.event_streams import EventStreams, RemoteRunnerLost
from scheduler.runners.interface import RunnerInfo
from scheduler.runners.ray_actor import ADAPTER_FILES, RunnerActor
from scheduler.runners.ray_events import Snapshot

__all__ = ["RayRunner", "RunnerActor", "ensure_ray"]
_init_lock = threading.Lock()


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join `address` (a Ray cluster; "auto" finds a local one) or start a local Ray once per
    process (no dashboard). Call it from a thread that lives as long as the process (the
    main one): a local Ray's head processes die with the thread that started them."""
    import ray

    with _init_lock:
        if ray.is_initialized():
            return
        kwargs = dict(include_dashboard=False, log_to_driver=True, ignore_reinit_error=True)
        if address:
            ray.init(address=address, **kwargs)
        else:
            ray.init(num_cpus=num_cpus or os.cpu_count(), **kwargs)


def _wants_gpu(config: EngineConfig) -> bool:
    """A runner takes a GPU (num_gpus=1) when its device is cuda, or "auto" on a Ray cluster
    that has GPUs (the actor's Engine then picks cuda itself)."""
    import ray

    device = config.model.device
    if device != "auto":
        return device.startswith("cuda")
    return ray.cluster_resources().get("GPU", 0) > 0


class RayRunner(EventStreams):
    """The scheduler's side of a RunnerActor (the protocol: event_streams.py). Building one
    blocks until the actor has loaded the model (run it on a worker thread)."""

    backend = "ray"
    # adapter name -> ((path, sha256), object ref of its files): shared by this process's runners
    _shipped: dict[str, tuple[tuple[str, str | None], object]] = {}

    def __init__(self, config: EngineConfig, runner_id: str, address: str | None = None) -> None:
        import ray

        ensure_ray(address)
        on_gpu = _wants_gpu(config)
        # the driver's PUNICA_X_RUNNER_THREADS reaches actors on every node (not only those
        # that inherit this process's environment through a local Ray)
        threads = os.environ.get("PUNICA_X_RUNNER_THREADS")
        env = {"env_vars": {"PUNICA_X_RUNNER_THREADS": threads}} if threads else None
        actor_cls = ray.remote(
            RunnerActor
        ).options(
            runtime_env=env,
            num_cpus=0 if not on_gpu else 1,
            num_gpus=1 if on_gpu else 0,
            max_concurrency=64,
            scheduling_strategy="SPREAD",  # runners on different nodes when there are several
            # readable in `ray list actors`; unique, since a second cluster in this process may
            # start its runner-1 before the first cluster's actor is gone
            name=f"punica-x-{runner_id}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
        )
        self.runner_id = runner_id
        self.actor = actor_cls.remote(config, runner_id)
        info: RunnerInfo = ray.get(self.actor.info.remote())
        self.info = info
        # a Lamina model worker's attention workers (detached actors): where to take its
        # requests' KV from should its process die (scheduler/lamina/rescue.py)
        self.lamina = ray.get(self.actor.lamina_workers.remote())
        self._lamina_heads = self.lamina.heads if self.lamina is not None else 0
        self._lamina_losses = 0
        self._rescue = None
        self._rescue_lock = threading.Lock()
        self._init_streams()
        _, self._snapshot = ray.get(self.actor.poll.remote(0, 0))  # its stats as it starts

    # -- the transport ------------------------------------------------------------------------
    async def _remote(self, method: str, *args):
        import ray

        try:
            return await getattr(self.actor, method).remote(*args)
        except ray.exceptions.RayActorError as exc:
            raise RemoteRunnerLost(f"runner process died: {exc}") from None
        except ray.exceptions.RayTaskError as exc:
            raise exc.as_instanceof_cause() from None

    def _send(self, method: str, *args) -> None:
        getattr(self.actor, method).remote(*args)

    async def _on_snapshot(self, snapshot: Snapshot) -> None:
        import ray

        losses = snapshot.stats.attention_worker_losses
        if losses != self._lamina_losses:  # workers were replaced: where they are now
            with contextlib.suppress(ray.exceptions.RayActorError):
                lamina = await self.actor.lamina_workers.remote()
                if lamina.heads == self._lamina_heads:  # else one is restarting: next poll
                    self.lamina, self._lamina_losses = lamina, losses

    def rescue_kv(self, request_id: str, num_tokens: int):
        """The first num_tokens tokens' KV of a request of this dead runner, read off its
        attention workers (a KVSnapshot), or None (no attention workers, or they do not
        hold it). Blocking: the mover calls it on a worker thread."""
        if self.lamina is None or self.error is None:
            return None
        from scheduler.lamina.rescue import KVRescue

        with self._rescue_lock:
            if self._rescue is None:
                self._rescue = KVRescue(self.lamina, self.info.block_size, self._lamina_heads)
            return self._rescue.kv(request_id, num_tokens)

    # -- adapters -----------------------------------------------------------------------------
    async def register_adapter(
        self,
        name: str,
        path: Path,
        sha256: str | None = None,
        version: int | None = None,
        pinned: bool | None = None,
    ) -> AdapterInfo:
        """The files at `path` go to the actor as bytes through the object store, put there
        once per version (runners started later get the same object, even if `path` is gone
        by then)."""
        import ray

        shipped = RayRunner._shipped.get(name)
        if shipped is not None and shipped[0] == (str(path), sha256):
            files_ref = shipped[1]  # read and put once, for every runner (and later ones)
        else:
            files = await asyncio.to_thread(
                lambda: {f: (Path(path) / f).read_bytes() for f in ADAPTER_FILES}
            )
            files_ref = ray.put(files)
            RayRunner._shipped[name] = ((str(path), sha256), files_ref)
        info = await self._call("register_adapter", name, files_ref, sha256, version, pinned)
        self._names.add(name)
        return info

    async def unregister_adapter(self, name: str) -> None:
        self._names.discard(name)
        RayRunner._shipped.pop(name, None)
        await self._call("unregister_adapter", name)

    def stop_lending(self) -> None:
        if self.error is None:
            self.actor.stop_lending.remote()  # fire and forget: it lends nothing from then on

    def stats(self) -> EngineStats:
        # a runner that never took a request still reports (a DistKV creditor's loans)
        with contextlib.suppress(RuntimeError):  # no running event loop here
            self._ensure_pump()
        return self._snapshot.stats

    def shutdown(self) -> None:
        import ray

        if self._pump is not None:
            self._pump.cancel()
        if self.error is None:
            with contextlib.suppress(Exception):
                ray.get(self.actor.shutdown.remote(), timeout=30)
        died = self.error is not None
        self.error = self.error or "shut down"
        ray.kill(self.actor)
        if not died:  # a dead one's attention workers wait for the rescue (release_lamina)
            self.release_lamina()

    def release_lamina(self) -> None:
        """Stop this runner's attention workers (detached actors: they outlive the runner's
        process unless stopped, or until they have been alone for ray_workers.ORPHAN_S)."""
        if self.lamina is None:
            return
        from scheduler.lamina.rescue import stop_workers

        with self._rescue_lock:
            if self._rescue is not None:
                self._rescue.close()
        stop_workers(self.lamina)
