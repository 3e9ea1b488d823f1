"""The Starlette application: the routes of every area (frontend/routes/), the OpenAPI
document built from the same endpoints, errors in the OpenAI shape, and the model loaded in
the background.

`/health` answers 200 as soon as the process is up and while it can serve (503 once no runner
is left and none is starting); `/ready` once a runner can take work (the model loads on a
background thread; API calls before that get 503 + Retry-After). A model that cannot be built
stops the server: `punica-x serve` exits 1 with the cause on stderr."""

from __future__ import annotations

import contextlib
import functools
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException

from frontend.config import ServerConfig
from frontend.http.errors import ApiError
from frontend.http.openapi import build_openapi
from frontend.routes import adapters, admin, lora_api, openai, system, ws
from frontend.state import ServerState

log = logging.getLogger("punica_x.server")
ENDPOINTS = (
    system.ENDPOINTS + openai.ENDPOINTS + adapters.ENDPOINTS + lora_api.ENDPOINTS + admin.ENDPOINTS
)


@functools.lru_cache(maxsize=2)
def document(model_id: str | None) -> dict:
    """The OpenAPI document of every endpoint, for the model served (None: still loading)."""
    return build_openapi(ENDPOINTS, model_id)


def create_app(config: ServerConfig) -> Starlette:
    state = ServerState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        serving = state.start_loading()
        try:
            yield
        finally:
            serving.cancel()
            state.shutdown()

    def openapi() -> dict:
        return document(state.manager.model_id if state.manager is not None else None)

    routes = [e.route() for e in ENDPOINTS] + list(ws.ROUTES)
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)
    app.state.server = state
    app.state.openapi = openapi
    app.add_middleware(AccessLog)
    return app


async def api_error(request, exc: ApiError):
    return exc.response()


async def http_error(request, exc: HTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return ApiError(exc.status_code, code, str(exc.detail)).response()


async def server_error(request, exc: Exception):
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return ApiError(500, "internal_error", "internal server error").response()


EXCEPTION_HANDLERS = {ApiError: api_error, HTTPException: http_error, Exception: server_error}


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
