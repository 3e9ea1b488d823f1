"""The websocket chat route (frontend/ws_chat.py speaks its protocol)."""

from __future__ import annotations

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket

from frontend.state import ServerState
from frontend.ws_chat import ws_chat

TRY_AGAIN_LATER = 1013


def routes(state: ServerState) -> list[WebSocketRoute]:
    async def websocket(ws: WebSocket):
        if state.manager is None:
            await ws.close(code=TRY_AGAIN_LATER)
            return
        await ws_chat(ws, state.manager, state.auth)

    return [WebSocketRoute("/v1/chat/ws", websocket)]
