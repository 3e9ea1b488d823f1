"""The websocket chat route (frontend/http/ws_chat.py speaks its protocol)."""

from __future__ import annotations

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket

from frontend.http.ws_chat import ws_chat
from frontend.routes.endpoint import server

TRY_AGAIN_LATER = 1013


async def websocket(ws: WebSocket):
    state = server(ws)
    if state.manager is None:
        await ws.close(code=TRY_AGAIN_LATER)
        return
    await ws_chat(ws, state.manager, state.auth)


ROUTES = (WebSocketRoute("/v1/chat/ws", websocket),)
