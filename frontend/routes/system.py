"""Routes of the server itself: health, readiness, the web page, the OpenAPI document and the
Prometheus metrics (admin token)."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from frontend.routes.endpoint import Endpoint, server

STATIC = Path(__file__).parent.parent / "static"


async def health(request: Request):
    """200 while the process can serve (loading included); 503 once it cannot: the model
    failed to load (the server then exits) or no runner is left and none is starting."""
    state = server(request)
    if state.healthy():
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unhealthy", "error": state.load_error}, status_code=503)


async def ready(request: Request):
    state = server(request)
    ok = state.manager is not None and state.scheduler.ready()
    return JSONResponse(
        {"status": "ready" if ok else "not_ready", "error": state.load_error},
        status_code=200 if ok else 503,
    )


async def index(request: Request):
    return FileResponse(STATIC / "index.html", media_type="text/html")


async def openapi_json(request: Request):
    """The OpenAPI document of every endpoint (create_app puts its builder on the app)."""
    return JSONResponse(request.app.state.openapi())


async def metrics(request: Request):
    manager = server(request).admin(request)
    return Response(manager.metrics.render(), media_type="text/plain; version=0.0.4")


ENDPOINTS = (
    Endpoint(
        "/health", ("GET",), health, "The process can serve", auth="none", statuses=(200, 503)
    ),
    Endpoint("/ready", ("GET",), ready, "A runner can take work", auth="none", statuses=(200, 503)),
    Endpoint("/", ("GET",), index, "The web chat page", auth="none"),
    Endpoint("/openapi.json", ("GET",), openapi_json, "This document", auth="none"),
    Endpoint("/metrics", ("GET",), metrics, "Prometheus metrics", auth="admin"),
)
