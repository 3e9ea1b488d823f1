"""Starting a cluster from one scheduler-side description: `ClusterSpec` (the engine every
runner runs, how many runners, which backend, the thread runners' devices, the Ray address,
the scheduler's own options) -> `build_scheduler(spec)`, the started runners under a
Scheduler, with a factory that starts one more of the same kind for scale-up and restarts."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from punica_x.api import EngineConfig
from scheduler.cluster import Scheduler, SchedulerConfig
from scheduler.runners.devices import device_of
from scheduler.runners.local import LocalRunner

BACKENDS = ("thread", "process", "ray")


@dataclass(frozen=True)
class ClusterSpec:
    """engine: what every runner loads and runs. runners: how many start (at least one).
    backend: "thread" (in this process; runners on one device share the backbone's weights)
    "process" (an engine process each, on this machine: scheduler/runners/process_runner.py)
    or "ray" (one actor each, at ray_address: "auto" the local cluster, None start one).
    devices: thread and process runners' devices, runner-i on devices[i % len] (() the
    engine's own).
    scheduler: the Scheduler's options."""

    engine: EngineConfig
    runners: int = 1
    backend: str = "thread"
    devices: tuple[str, ...] = ()
    ray_address: str | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.runners < 1:
            raise ValueError(f"a cluster needs at least one runner, got {self.runners}")


def build_scheduler(spec: ClusterSpec) -> Scheduler:
    """spec.runners runners of spec.backend under a Scheduler, and their factory."""
    if spec.backend == "ray":
        return _ray_cluster(spec)
    if spec.backend == "process":
        return _process_cluster(spec)
    factory = thread_factory(spec)
    runners = [factory(f"runner-{i}") for i in range(spec.runners)]
    return Scheduler.from_config(spec.scheduler, runners, factory)


def thread_factory(spec: ClusterSpec):
    """runner_id -> a LocalRunner on its device; the runners of one device share the weights
    the first of them loaded."""
    shared: dict[str, object] = {}  # device -> the weights its thread runners share

    def factory(runner_id: str) -> LocalRunner:
        engine = spec.engine
        if spec.devices:
            device = device_of(runner_id, spec.devices)
            engine = replace(engine, model=replace(engine.model, device=device))
        key = engine.model.device
        runner = LocalRunner(engine, runner_id, shared=shared.get(key))
        shared.setdefault(key, runner.engine.loaded)
        return runner

    return factory


def _ray_cluster(spec: ClusterSpec) -> Scheduler:
    from punica_x.api import describe_model
    from scheduler.runners.ray_runner import RayRunner, ensure_ray

    meta = describe_model(spec.engine.model)  # the tokenizer here; weights only in the actors
    ensure_ray(spec.ray_address)

    def factory(runner_id: str) -> RayRunner:
        return RayRunner(spec.engine, runner_id, spec.ray_address)

    ids = [f"runner-{i}" for i in range(spec.runners)]
    with ThreadPoolExecutor(max_workers=spec.runners) as pool:  # the actors load at once
        runners = list(pool.map(factory, ids))
    return Scheduler.from_config(spec.scheduler, runners, factory, tokenizer=meta.tokenizer)


def _process_cluster(spec: ClusterSpec) -> Scheduler:
    from punica_x.api import describe_model
    from scheduler.runners.process_runner import ProcessRunner

    meta = describe_model(spec.engine.model)  # the tokenizer here; weights only in the processes

    def factory(runner_id: str) -> ProcessRunner:
        engine = spec.engine
        if spec.devices:
            device = device_of(runner_id, spec.devices)
            engine = replace(engine, model=replace(engine.model, device=device))
        return ProcessRunner(engine, runner_id)

    ids = [f"runner-{i}" for i in range(spec.runners)]
    with ThreadPoolExecutor(max_workers=spec.runners) as pool:  # they load at once
        runners = list(pool.map(factory, ids))
    return Scheduler.from_config(spec.scheduler, runners, factory, tokenizer=meta.tokenizer)
