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
from collections.abc import Callable
from pathlib import Path

from punica_x.api import (
    AdapterInfo,
    EngineConfig,
    EngineRequest,
    EngineStats,
    RequestLimits,
    RequestOutput,
    RequestStream,
    Resume,
    RunnerLost,
    SamplingParams,
    UnknownAdapterError,
)
from scheduler.runners.interface import RunnerInfo
from scheduler.runners.ray_actor import ADAPTER_FILES, RunnerActor
from scheduler.runners.ray_events import Event, LostEvent, OutputEvent, PreemptEvent

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


class RayRunner:
    """The scheduler's side of a RunnerActor. Building one blocks until the actor has loaded
    the model (run it on a worker thread)."""

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
        self._lamina_losses = 0
        self._rescue = None
        self._rescue_lock = threading.Lock()
        self.tokenizer = None  # the scheduler brings its own (describe_model)
        self.error: str | None = None
        self._names: set[str] = set()
        self._streams: dict[str, tuple[Callable, Callable | None]] = {}
        _, self._snapshot = ray.get(self.actor.poll.remote(0, 0))  # its stats as it starts
        self._pump: asyncio.Task | None = None
        self._acked = 0  # highest event seq the pump has dispatched
        self._delivered: dict[str, int] = {}  # request id -> seq of its last delivered event
        self.kv_capacity = 0  # blocks its peers could lend one request (DistKV; RayKVGroup)

    # -- requests -----------------------------------------------------------------------------
    def validate(self, prompt: list[int], sampling: SamplingParams, adapter: str | None) -> None:
        self.limits().check(prompt, sampling)
        if adapter is not None and adapter not in self._names:
            raise UnknownAdapterError(adapter)

    def limits(self) -> RequestLimits:
        i = self.info
        return RequestLimits(
            i.vocab_size,
            i.model.max_model_len,
            i.block_size,
            i.kv_blocks_total + self.kv_capacity,
            "the cluster's KV caches (DistKV) hold" if self.kv_capacity else "the KV cache holds",
        )

    async def open(
        self, request: EngineRequest, on_preempt: Callable[[], None] | None = None
    ) -> RequestStream:
        self._ensure_pump()
        if self.error is not None:
            raise RunnerLost(self.error)
        request_id = request.request_id
        outputs: asyncio.Queue[RequestOutput | RunnerLost] = asyncio.Queue()
        self._streams[request_id] = (outputs.put_nowait, on_preempt)
        try:
            await self._call(self.actor.open.remote(request))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return RequestStream(request_id, outputs, lambda: self._abort(request_id))

    def _abort(self, request_id: str) -> None:
        self._forget(request_id)
        if self.error is None:
            self.actor.abort.remote(request_id)  # fire and forget: its output is dropped

    async def take(self, request_id: str, with_kv: bool = False) -> Resume | None:
        resume, events = await self._call(self.actor.take.remote(request_id, with_kv))
        self._dispatch(events)  # what the pump has not delivered yet, in order
        self._forget(request_id)
        return resume

    async def _call(self, ref):
        import ray

        try:
            return await ref
        except ray.exceptions.RayActorError as exc:
            self._lost(f"runner process died: {exc}")
            raise RunnerLost(self.error) from None
        except ray.exceptions.RayTaskError as exc:
            raise exc.as_instanceof_cause() from None

    # -- the pump -----------------------------------------------------------------------------
    def _ensure_pump(self) -> None:
        if (self._pump is None or self._pump.done()) and self.error is None:
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())

    async def _run_pump(self) -> None:
        import ray

        while self.error is None:
            try:
                events, snapshot = await self.actor.poll.remote(self._acked)
            except ray.exceptions.RayActorError as exc:
                self._lost(f"runner process died: {exc}")
                return
            except Exception as exc:  # an unexpected failure must not hang every stream
                self._lost(f"runner unreachable: {exc}")
                return
            self._snapshot = snapshot
            if snapshot.stats.attention_worker_losses != self._lamina_losses:
                self._lamina_losses = snapshot.stats.attention_worker_losses
                with contextlib.suppress(ray.exceptions.RayActorError):
                    self.lamina = await self.actor.lamina_workers.remote()  # replaced ones
            self._dispatch(events)
            if events:
                self._acked = max(self._acked, events[-1].seq)

    def _dispatch(self, events: list[Event]) -> None:
        """Deliver events in seq order, each once (a take and a poll may both carry one)."""
        for event in events:
            rid = event.request_id
            entry = self._streams.get(rid)
            if entry is None or event.seq <= self._delivered.get(rid, 0):
                continue
            self._delivered[rid] = event.seq
            deliver, on_preempt = entry
            if isinstance(event, OutputEvent):
                deliver(event.output)
                if event.output.finished:
                    self._forget(rid)
            elif isinstance(event, PreemptEvent):
                if on_preempt is not None:
                    on_preempt()
            elif isinstance(event, LostEvent):
                self.error = self.error or event.error
                self._forget(rid)
                deliver(RunnerLost(event.error, event.in_failed_step))

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._delivered.pop(request_id, None)

    def rescue_kv(self, request_id: str, num_tokens: int):
        """The first num_tokens tokens' KV of a request of this dead runner, read off its
        attention workers (a KVSnapshot), or None (no attention workers, or they do not
        hold it). Blocking: the mover calls it on a worker thread."""
        if self.lamina is None or self.error is None:
            return None
        from scheduler.lamina.rescue import KVRescue

        with self._rescue_lock:
            if self._rescue is None:
                self._rescue = KVRescue(self.lamina, self.info.block_size)
            return self._rescue.kv(request_id, num_tokens)

    def _lost(self, error: str) -> None:
        self.error = self.error or error
        streams, self._streams = self._streams, {}
        for deliver, _ in streams.values():
            deliver(RunnerLost(self.error))

    # -- adapters -----------------------------------------------------------------------------
    async def register_adapter(
        self, name: str, path: Path, sha256: str | None = None, version: int | None = None
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
        info = await self._call(
            self.actor.register_adapter.remote(name, files_ref, sha256, version)
        )
        self._names.add(name)
        return info

    async def unregister_adapter(self, name: str) -> None:
        self._names.discard(name)
        RayRunner._shipped.pop(name, None)
        await self._call(self.actor.unregister_adapter.remote(name))

    def has_version(self, version: int) -> bool:
        return version in self._snapshot.versions

    def resident_adapters(self) -> frozenset[str]:
        return self._snapshot.resident

    def stop_lending(self) -> None:
        if self.error is None:
            self.actor.stop_lending.remote()  # fire and forget: it lends nothing from then on

    def stats(self) -> EngineStats:
        # a runner that never took a request still reports (a DistKV creditor's loans)
        with contextlib.suppress(RuntimeError):  # no running event loop here
            self._ensure_pump()
        return self._snapshot.stats

    def alive(self) -> bool:
        return self.error is None

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
