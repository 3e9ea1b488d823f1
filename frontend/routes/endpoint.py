"""An HTTP endpoint as the app and the OpenAPI document both see it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel
from starlette.requests import HTTPConnection
from starlette.routing import Route

from frontend.state import ServerState

AUTHS = ("tenant", "admin", "none")


@dataclass(frozen=True)
class Endpoint:
    """path (Starlette syntax, {name} parameters), methods, the handler(request), and for the
    OpenAPI document: summary, the JSON body model (or a hand-written request body schema for
    multipart), who may call it (auth), the query parameters ({name: JSON schema}) and the
    statuses it answers besides the 4xx every route may answer."""

    path: str
    methods: tuple[str, ...]
    handler: Callable
    summary: str
    body: type[BaseModel] | None = None
    raw_body: dict | None = None  # OpenAPI requestBody object when the body is not JSON
    auth: str = "tenant"
    query: tuple[tuple[str, dict], ...] = ()
    statuses: tuple[int, ...] = (200,)
    streams: bool = False  # answers text/event-stream when asked to
    example: dict | None = None  # a valid body; the string "{model}" stands for the model id

    def __post_init__(self) -> None:
        if self.auth not in AUTHS:
            raise ValueError(f"auth must be one of {AUTHS}, got {self.auth!r}")

    def route(self) -> Route:
        return Route(self.path, self.handler, methods=list(self.methods))


def server(conn: HTTPConnection) -> ServerState:
    """The server's state, from the app serving this request or websocket (create_app puts it
    there), so handlers are plain module-level functions."""
    return conn.app.state.server
