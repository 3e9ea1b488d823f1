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

ray is imported on first use, so the thread backend never pays for it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from punica_x.async_engine import RequestStream, RunnerLost
from punica_x.config import EngineConfig
from punica_x.core import RequestOutput, Resume, SamplingParams
from punica_x.lora.pool import AdapterInfo, UnknownAdapterError
from scheduler.interface import RequestLimits, RunnerInfo, RunnerStats

log = logging.getLogger(__name__)

POLL_TIMEOUT = 1.0  # seconds an idle poll waits before returning (nothing) to the pump
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_init_lock = threading.Lock()


@dataclass(frozen=True)
class Snapshot:
    """What a poll reply carries besides the events: the runner's stats, the adapters
    resident on its device and the adapter versions it still holds."""

    stats: RunnerStats
    resident: frozenset[str]
    versions: frozenset[int]


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


class RunnerActor:
    """Runs in the actor's process (an async actor: its methods share one event loop)."""

    def __init__(self, config: EngineConfig, runner_id: str) -> None:
        import tempfile

        import torch

        from punica_x.async_engine import AsyncEngine
        from punica_x.engine import Engine

        # Ray starts actors with OMP_NUM_THREADS=1; a runner wants every core it was given
        # (the thread backend's default too), or PUNICA_X_RUNNER_THREADS when set.
        threads = int(os.environ.get("PUNICA_X_RUNNER_THREADS", 0)) or len(os.sched_getaffinity(0))
        torch.set_num_threads(threads)
        self.runner_id = runner_id
        self.engine = Engine(config)
        self.async_engine = AsyncEngine(self.engine, on_step_error="stop")
        from scheduler.local import describe_runner

        self.info_ = describe_runner(self.engine, config)
        self.adapter_dir = Path(tempfile.mkdtemp(prefix=f"punica-x-{runner_id}-adapters-"))
        # (seq, kind, request id, payload), kept until a poll acknowledges them: a reply lost
        # on the way (its caller gone) is sent again, so no output is ever dropped
        self.events: list[tuple[int, str, str, object]] = []
        self.seq = 0
        self.wakeup: asyncio.Event | None = None

    def info(self) -> RunnerInfo:
        return self.info_

    def stop_lending(self) -> None:
        from scheduler.local import stop_lending

        stop_lending(self.engine)

    def _push(self, kind: str, request_id: str, payload: object) -> None:
        self.seq += 1
        self.events.append((self.seq, kind, request_id, payload))
        if self.wakeup is not None:
            self.wakeup.set()

    async def open(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        adapter: str | None,
        request_id: str,
        resume: Resume | None,
    ) -> str:
        def deliver(out):
            if isinstance(out, RunnerLost):  # (why, whether the request was in the step)
                self._push("lost", request_id, (str(out), out.in_failed_step))
            else:
                self._push("out", request_id, out)

        def preempted():
            self._push("preempt", request_id, None)

        return await self.async_engine.add(
            prompt, sampling, adapter, request_id, resume, deliver, preempted
        )

    async def take(self, request_id: str, with_kv: bool = False) -> tuple[Resume | None, list]:
        """(where the request stands, its events not yet acknowledged): after a take the
        request produces nothing more here."""
        resume = await self.async_engine.take(request_id, with_kv)
        return resume, [e for e in self.events if e[2] == request_id]

    async def abort(self, request_id: str) -> None:
        await self.async_engine.call(lambda: self.engine.abort(request_id))

    async def poll(self, after: int, timeout: float = POLL_TIMEOUT) -> tuple[list, Snapshot]:
        """Events after seq `after` (those up to it are acknowledged and dropped), waiting up
        to `timeout` for one; and the runner's stats."""
        if self.wakeup is None:
            self.wakeup = asyncio.Event()
        self.events = [e for e in self.events if e[0] > after]
        if not self.events:
            self.wakeup.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wakeup.wait(), timeout)
        return list(self.events), self._snapshot()

    def _snapshot(self) -> Snapshot:
        from scheduler.local import engine_stats

        pool = self.engine.adapters
        return Snapshot(engine_stats(self.engine), pool.resident(), pool.versions())

    def register_adapter(
        self, name: str, files: dict[str, bytes], sha256: str | None, version: int
    ) -> AdapterInfo:
        folder = self.adapter_dir / f"{abs(hash(name))}-{version}"
        folder.mkdir(parents=True, exist_ok=True)
        for fname in _ADAPTER_FILES:
            (folder / fname).write_bytes(files[fname])
        return self.engine.adapters.register(name, folder, sha256)

    def unregister_adapter(self, name: str) -> None:
        self.engine.adapters.unregister(name)

    # -- DistKV (scheduler/distkv/ray_group.py) ---------------------------------------------------
    def kv_enable(
        self,
        gmanager,
        peers: dict,
        capacity: int,
        caps,
        overlap: bool,
        transport: str,
        authkey: bytes,
    ):
        """Lend within `caps`, borrow through the ledger actor from `peers` (runner id ->
        actor handle); serve the micro-attention of this runner's loans on a channel server
        (transport "socket"). Returns the server's ChannelAddress (None with "ray")."""
        from concurrent.futures import ThreadPoolExecutor

        import ray

        from scheduler.distkv.channel import KVChannelServer
        from scheduler.distkv.ray_group import DataPlane, RayBorrower

        plane = DataPlane(transport, authkey, self.info_.node)
        self.borrower = RayBorrower(self.runner_id, gmanager, peers, capacity, plane)
        self.kv_pool = ThreadPoolExecutor(4, thread_name_prefix="distkv")
        self.rm = self.engine.enable_distkv(
            self.runner_id, self.borrower, caps, overlap, pool=self.kv_pool
        )
        self.borrower.local = self.rm
        self.micro: dict[str, object] = {}
        self.kv_server = None
        if transport == "socket":
            host = ray.util.get_node_ip_address()
            self.kv_server = KVChannelServer(self.rm, authkey, self.info_.node, host)
            return self.kv_server.address
        return None

    def kv_peers(self, peers: dict, addresses: dict, capacity: int) -> None:
        self.borrower.set_peers(peers, addresses, capacity)

    def kv_counts(self) -> dict[str, int]:
        """Now: blocks this runner lends (`lent`), micro-attention calls its rManager ran
        (`calls`) and frames its channel server received (`frames`)."""
        frames = self.kv_server.frames if self.kv_server is not None else 0
        return {"lent": self.rm.lent_blocks, "calls": self.rm.calls, "frames": frames}

    def kv_heartbeat(self):
        from scheduler.distkv.ledger import Heartbeat

        return Heartbeat(self.runner_id, self.rm.lendable(), 0.0, self.info_.node)

    def kv_lend(self, debtor: str, request_id: str, num_blocks: int):
        return self.rm.lend(debtor, request_id, num_blocks)

    def kv_reclaim(self, debtor: str, request_id: str, block_ids: tuple[int, ...]) -> None:
        self.rm.reclaim(debtor, request_id, block_ids)

    def kv_reclaim_debtor(self, debtor: str) -> int:
        self.micro.pop(debtor, None)
        return self.rm.reclaim_debtor(debtor)

    def kv_prepare(self, debtor: str, plan) -> None:
        """One debtor step's plan over blocks lent to it (replaces its previous step's)."""
        self.micro[debtor] = self.rm.prepare(debtor, plan)

    def kv_run(self, debtor: str, layer: int, q, k, v, scale: float):
        return self.micro[debtor].run(layer, q, k, v, scale)

    # -- DGFM (scheduler/distkv/ray_group.py RayKVGroup.defragment drives these) -------------
    def dgfm_hold(self, timeout: float = 30.0) -> None:
        """Hold the engine thread between two steps (a command that waits for dgfm_release)
        and lend nothing meanwhile; returns once it is held."""
        try:  # (held 120 s at most: a scheduler that died mid-swap does not hold it forever)
            self._dgfm_release = self.async_engine.hold(timeout, limit=120.0)
        except TimeoutError as exc:
            raise TimeoutError(f"runner {self.runner_id}: {exc}") from None
        self.rm.frozen = True

    def dgfm_release(self) -> None:
        self.rm.frozen = False
        release = getattr(self, "_dgfm_release", None)
        if release is not None:
            release()

    def dgfm_pick(self, creditor: str, blocks: int) -> list[tuple[str, tuple[int, ...]]]:
        from scheduler.distkv.network import pick

        return pick(self.engine, creditor, blocks)

    def dgfm_take(self, debtor: str, picks: list) -> list:
        from scheduler.distkv.network import take_home

        return [kv.cpu() for kv in take_home(self.rm, debtor, picks)]  # to another process

    def dgfm_put(self, creditor: str, picks: list, data: list) -> None:
        from scheduler.distkv.network import bring_home

        bring_home(self.engine, self.runner_id, creditor, picks, data)

    def alive(self) -> str | None:
        """None while the engine steps, else why it stopped."""
        return None if self.async_engine.alive() else (self.async_engine.error or "stopped")

    def shutdown(self) -> None:
        import shutil

        self.async_engine.shutdown()
        if getattr(self, "kv_server", None) is not None:
            self.kv_server.close()
            self.borrower.close()
        shutil.rmtree(self.adapter_dir, ignore_errors=True)


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
        self.tokenizer = None  # the scheduler brings its own (describe_model)
        self.error: str | None = None
        self._names: set[str] = set()
        self._streams: dict[str, tuple[Callable, Callable | None]] = {}
        empty = RunnerStats(0, 0, 0, info.kv_blocks_total, 0, 0, 0, 0)
        self._snapshot = Snapshot(empty, frozenset(), frozenset())
        self._pump: asyncio.Task | None = None
        self._acked = 0  # highest event seq the pump has dispatched
        self._delivered: dict[str, int] = {}  # request id -> seq of its last delivered event
        self._versions = 0
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
        self,
        prompt: list[int],
        sampling: SamplingParams,
        adapter: str | None,
        request_id: str,
        resume: Resume | None = None,
        on_preempt: Callable[[], None] | None = None,
    ) -> RequestStream:
        self._ensure_pump()
        if self.error is not None:
            raise RunnerLost(self.error)
        outputs: asyncio.Queue[RequestOutput | RunnerLost] = asyncio.Queue()
        self._streams[request_id] = (outputs.put_nowait, on_preempt)
        try:
            await self._call(self.actor.open.remote(prompt, sampling, adapter, request_id, resume))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return RequestStream(request_id, outputs, lambda: self._abort(request_id))

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._delivered.pop(request_id, None)
        if self.error is None:
            self.actor.abort.remote(request_id)  # fire and forget: its output is dropped

    async def take(self, request_id: str, with_kv: bool = False) -> Resume | None:
        resume, events = await self._call(self.actor.take.remote(request_id, with_kv))
        self._dispatch(events)  # what the pump has not delivered yet, in order
        self._streams.pop(request_id, None)
        self._delivered.pop(request_id, None)
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
            self._dispatch(events)
            if events:
                self._acked = max(self._acked, events[-1][0])

    def _dispatch(self, events: list) -> None:
        """Deliver events in seq order, each once (a take and a poll may both carry one)."""
        for seq, kind, request_id, payload in events:
            entry = self._streams.get(request_id)
            if entry is None or seq <= self._delivered.get(request_id, 0):
                continue
            self._delivered[request_id] = seq
            deliver, on_preempt = entry
            if kind == "out":
                deliver(payload)
                if payload.finished:
                    self._streams.pop(request_id, None)
                    self._delivered.pop(request_id, None)
            elif kind == "preempt":
                if on_preempt is not None:
                    on_preempt()
            elif kind == "lost":
                error, in_failed_step = payload
                self.error = self.error or error
                self._streams.pop(request_id, None)
                self._delivered.pop(request_id, None)
                deliver(RunnerLost(error, in_failed_step))

    def _lost(self, error: str) -> None:
        self.error = self.error or error
        streams, self._streams = self._streams, {}
        for deliver, _ in streams.values():
            deliver(RunnerLost(self.error))

    # -- adapters -----------------------------------------------------------------------------
    async def register_adapter(
        self, name: str, path: Path, sha256: str | None = None
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
                lambda: {f: (Path(path) / f).read_bytes() for f in _ADAPTER_FILES}
            )
            files_ref = ray.put(files)
            RayRunner._shipped[name] = ((str(path), sha256), files_ref)
        self._versions += 1
        info = await self._call(
            self.actor.register_adapter.remote(name, files_ref, sha256, self._versions)
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

    def stats(self) -> RunnerStats:
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
        self.error = self.error or "shut down"
        ray.kill(self.actor)
