"""The server's state: the store, auth, and the model loaded on a background thread, then the
frontend manager once a runner can take work (`/ready`)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from starlette.requests import HTTPConnection

from frontend.config import ServerConfig
from frontend.http.errors import ApiError
from frontend.manager import Caller, FrontendManager
from frontend.tenancy.auth import Authenticator, ensure_admin_token
from frontend.tenancy.recovery import recover
from frontend.tenancy.store import Store
from punica_x.api import freeze_heap
from scheduler.build import ClusterSpec, build_scheduler
from scheduler.cluster import RestartPolicy, Scheduler, SchedulerConfig

log = logging.getLogger("punica_x.server")
GC_INTERVAL = 5.0


class ServerState:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.store = Store(config.data_dir)
        recover(self.store)  # before anything is served: finish or undo what a kill cut short
        token, self.admin_token_path, self.admin_token_created = ensure_admin_token(config.data_dir)
        self.auth = Authenticator(self.store, token)
        self.manager: FrontendManager | None = None
        self.scheduler: Scheduler | None = None
        self.load_error: str | None = None
        # set by `serve`: stops the HTTP server (it then exits non-zero when the load failed)
        self.stop_server: Callable[[], None] | None = None
        if config.runner_backend == "ray":
            # here, on the main thread: Ray's head processes die with the thread that
            # started them (PR_SET_PDEATHSIG), and the loader thread below ends
            from scheduler.runners.ray_runner import ensure_ray

            ensure_ray(config.ray_address)

    def load(self) -> None:
        """Load the model and start the runner (runs on a background thread)."""
        try:
            self.scheduler = build_scheduler(cluster_spec(self.config))
        except Exception as exc:
            log.exception("loading the model failed")
            self.load_error = f"{type(exc).__name__}: {exc}"

    def require_manager(self) -> FrontendManager:
        if self.manager is None:
            detail = f" ({self.load_error})" if self.load_error else " (the model is loading)"
            raise ApiError(503, "not_ready", "the server is not ready" + detail, retry_after=5)
        return self.manager

    def caller(self, conn: HTTPConnection) -> tuple[FrontendManager, Caller]:
        """The manager and the tenant calling (503 until ready, 401 without a valid key)."""
        manager = self.require_manager()
        tenant, key_hash = self.auth.tenant(conn)
        return manager, Caller(tenant, key_hash)

    def admin(self, conn: HTTPConnection) -> FrontendManager:
        """The manager, for a caller holding the admin token (401 otherwise)."""
        self.auth.admin(conn)
        return self.require_manager()

    def healthy(self) -> bool:
        """The process can serve, now or once loaded: False after a failed load, or once no
        runner is left and none is starting (the restart policy gave up, or is off)."""
        if self.load_error is not None:
            return False
        return self.scheduler is None or self.manager is None or self.scheduler.accepting()

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.requests.close()
        if self.scheduler is not None:
            self.scheduler.shutdown()

    def start_loading(self) -> asyncio.Task:
        """Load the model on a thread; the task serves once it is loaded (cancel to stop)."""
        loader = threading.Thread(target=self.load, name="punica-x-load", daemon=True)
        loader.start()
        return asyncio.create_task(_when_loaded(self, loader))


def cluster_spec(config: ServerConfig) -> ClusterSpec:
    """The server's flags as the scheduler's description of the cluster to start (with
    autoscaling, at least its minimum of runners)."""
    n = config.runners
    if config.autoscale:
        from scheduler.autoscale import AutoscaleConfig

        n = max(n, AutoscaleConfig.parse(config.autoscale).min_runners)
    return ClusterSpec(
        engine=config.engine,
        runners=n,
        backend=config.runner_backend,
        devices=config.devices,
        ray_address=config.ray_address,
        scheduler=SchedulerConfig(
            idle_after=config.idle_after_s,
            distkv=config.distkv,
            restart=RestartPolicy() if config.restart_runners else None,
            fair_share=config.fair_share,
        ),
    )


async def _when_loaded(state: ServerState, loader: threading.Thread) -> None:
    while loader.is_alive():
        await asyncio.sleep(0.1)
    if state.scheduler is None:  # the load failed: a server that cannot serve exits
        if state.stop_server is not None:
            state.stop_server()
        return
    manager = FrontendManager(state.config, state.scheduler, state.store)
    await manager.restore_adapters()
    freeze_heap("server ready")  # the model, runners and stored adapters (punica_x/heap.py)
    state.manager = manager
    log.info("ready: serving %s", manager.model_id)
    scaler = None
    if state.config.autoscale:
        from scheduler.autoscale import AutoscaleConfig, Autoscaler

        config = AutoscaleConfig.parse(state.config.autoscale)
        scaler = asyncio.create_task(Autoscaler(state.scheduler, config).run())
        log.info("autoscaling between %d and %d runners", config.min_runners, config.max_runners)
    try:
        while True:
            await asyncio.sleep(GC_INTERVAL)
            manager.collect_garbage()
    finally:
        if scaler is not None:
            scaler.cancel()
