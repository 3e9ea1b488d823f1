"""The Starlette application: routes, auth, errors, and the model loaded in the background.

`/health` answers as soon as the process is up; `/ready` once a runner can take work (the
model loads on a background thread; API calls before that get 503 + Retry-After)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from frontend import admin_api, openai_api
from frontend.auth import Authenticator, ensure_admin_token
from frontend.config import ServerConfig
from frontend.errors import ApiError
from frontend.manager import Caller, FrontendManager
from frontend.recovery import recover
from frontend.store import Store
from frontend.uploads import read_upload
from frontend.ws_chat import ws_chat
from scheduler.cluster import Scheduler
from scheduler.local import LocalRunner

log = logging.getLogger("punica_x.server")
STATIC = Path(__file__).parent / "static"
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
        if config.runner_backend == "ray":
            # here, on the main thread: Ray's head processes die with the thread that
            # started them (PR_SET_PDEATHSIG), and the loader thread below ends
            from scheduler.ray_runner import ensure_ray

            ensure_ray(config.ray_address)

    def load(self) -> None:
        """Load the model and start the runner (runs on a background thread)."""
        try:
            self.scheduler = build_scheduler(self.config)
        except Exception as exc:
            log.exception("loading the model failed")
            self.load_error = f"{type(exc).__name__}: {exc}"

    def require_manager(self) -> FrontendManager:
        if self.manager is None:
            detail = f" ({self.load_error})" if self.load_error else " (the model is loading)"
            raise ApiError(503, "not_ready", "the server is not ready" + detail, retry_after=5)
        return self.manager


def build_scheduler(config: ServerConfig) -> Scheduler:
    """config.runners runners of config.runner_backend, and a factory for more (scale up).
    thread: in this process, sharing the backbone's weights; ray: one Ray actor each."""
    engine, n = config.engine, config.runners
    if config.autoscale:
        from scheduler.autoscale import AutoscaleConfig

        n = max(n, AutoscaleConfig.parse(config.autoscale).min_runners)
    if config.runner_backend == "ray":
        from punica_x.models.loader import describe_model
        from scheduler.ray_runner import RayRunner, ensure_ray

        meta = describe_model(engine.model)  # the tokenizer here; weights only in the actors
        ensure_ray(config.ray_address)

        def ray_factory(runner_id: str) -> RayRunner:
            return RayRunner(engine, runner_id, config.ray_address)

        with ThreadPoolExecutor(max_workers=n) as pool:  # the actors load their models at once
            runners = list(pool.map(ray_factory, [f"runner-{i}" for i in range(n)]))
        return Scheduler(
            runners,
            ray_factory,
            config.idle_after_s,
            tokenizer=meta.tokenizer,
            distkv=config.distkv,
        )
    first = LocalRunner(engine, "runner-0")
    shared = first.engine.loaded

    def factory(runner_id: str) -> LocalRunner:
        return LocalRunner(engine, runner_id, shared=shared)

    runners = [first] + [factory(f"runner-{i}") for i in range(1, n)]
    return Scheduler(runners, factory, config.idle_after_s, distkv=config.distkv)


def create_app(config: ServerConfig) -> Starlette:
    state = ServerState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loader = threading.Thread(target=state.load, name="punica-x-load", daemon=True)
        loader.start()
        ready = asyncio.create_task(_when_loaded(state, loader))
        try:
            yield
        finally:
            ready.cancel()
            if state.scheduler is not None:
                state.scheduler.shutdown()

    def caller(request) -> tuple[FrontendManager, Caller]:
        manager = state.require_manager()
        tenant, key_hash = state.auth.tenant(request)
        return manager, Caller(tenant, key_hash)

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def ready(request: Request):
        ok = state.manager is not None and state.scheduler.ready()
        return JSONResponse(
            {"status": "ready" if ok else "not_ready", "error": state.load_error},
            status_code=200 if ok else 503,
        )

    async def index(request: Request):
        return FileResponse(STATIC / "index.html", media_type="text/html")

    async def metrics(request: Request):
        state.auth.admin(request)
        manager = state.require_manager()
        return Response(manager.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(request: Request):
        manager, who = caller(request)
        return openai_api.list_models(manager, who)

    async def completions(request: Request):
        manager, who = caller(request)
        return await openai_api.completions(manager, who, request, chat=False)

    async def chat_completions(request: Request):
        manager, who = caller(request)
        return await openai_api.completions(manager, who, request, chat=True)

    async def upload_adapter(request: Request):
        manager, who = caller(request)
        name, files = await read_upload(request, config.limits)
        record = await manager.upload_adapter(who, name, files)
        return JSONResponse(record.public(manager.serving_dtype), status_code=201)

    async def list_adapters(request: Request):
        manager, who = caller(request)
        return JSONResponse(
            {
                "object": "list",
                "data": [a.public(manager.serving_dtype) for a in manager.list_adapters(who)],
            }
        )

    async def adapter(request: Request):
        manager, who = caller(request)
        name = request.path_params["name"]
        if request.method == "DELETE":
            record = await manager.delete_adapter(who, name)
            return JSONResponse({**record.public(manager.serving_dtype), "deleted": True})
        return JSONResponse(manager.get_adapter(who, name).public(manager.serving_dtype))

    async def tenants(request: Request):
        state.auth.admin(request)
        manager = state.require_manager()
        if request.method == "POST":
            body = await openai_api.read_json(request, 64 * 1024)
            tenant, key = manager.create_tenant(
                body.get("name"), body.get("max_concurrent"), body.get("tokens_per_minute")
            )
            return JSONResponse({**_tenant_json(tenant), "api_key": key}, status_code=201)
        return JSONResponse(
            {"object": "list", "data": [_tenant_json(t) for t in state.store.tenants()]}
        )

    async def tenant(request: Request):
        state.auth.admin(request)
        revoked = state.require_manager().revoke_tenant(request.path_params["name"])
        return JSONResponse(_tenant_json(revoked))

    async def runners(request: Request):
        state.auth.admin(request)
        state.require_manager()
        return await admin_api.runners(request, state.scheduler)

    async def runner(request: Request):
        state.auth.admin(request)
        state.require_manager()
        return await admin_api.runner(request, state.scheduler)

    async def websocket(ws: WebSocket):
        if state.manager is None:
            await ws.close(code=1013)  # try again later
            return
        await ws_chat(ws, state.manager, state.auth)

    async def api_error(request, exc: ApiError):
        return exc.response()

    async def http_error(request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return ApiError(exc.status_code, code, str(exc.detail)).response()

    async def server_error(request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return ApiError(500, "internal_error", "internal server error").response()

    routes = [
        Route("/health", health),
        Route("/ready", ready),
        Route("/", index),
        Route("/metrics", metrics),
        Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/adapters", upload_adapter, methods=["POST"]),
        Route("/v1/adapters", list_adapters, methods=["GET"]),
        Route("/v1/adapters/{name}", adapter, methods=["GET", "DELETE"]),
        Route("/admin/tenants", tenants, methods=["GET", "POST"]),
        Route("/admin/tenants/{name}", tenant, methods=["DELETE"]),
        Route("/admin/runners", runners, methods=["GET", "POST", "DELETE"]),
        Route("/admin/runners/{runner_id}", runner, methods=["DELETE"]),
        WebSocketRoute("/v1/chat/ws", websocket),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            ApiError: api_error,
            HTTPException: http_error,
            Exception: server_error,
        },
    )
    app.state.server = state
    app.add_middleware(AccessLog)
    return app


async def _when_loaded(state: ServerState, loader: threading.Thread) -> None:
    while loader.is_alive():
        await asyncio.sleep(0.1)
    if state.scheduler is None:
        return
    manager = FrontendManager(state.config, state.scheduler, state.store)
    await manager.restore_adapters()
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


def _tenant_json(t) -> dict:
    return {
        "id": t.id,
        "name": t.name,
        "created": int(t.created),
        "revoked": t.revoked,
        "max_concurrent": t.max_concurrent,
        "tokens_per_minute": t.tokens_per_minute,
    }


class AccessLog:
    """method, path (never the query string: it may carry a websocket token), status, time."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        start, status = time.monotonic(), [0]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            log.info(
                "%s %s %s %.1fms",
                scope.get("method", "WS"),
                scope["path"],
                status[0] or "-",
                (time.monotonic() - start) * 1e3,
            )
