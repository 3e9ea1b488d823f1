"""WS /v1/chat/ws: streaming chat over a websocket, several turns per connection.

The key is checked before the socket is accepted (Authorization header, or a `token` query
parameter for browsers; it is never logged). Client frames (frontend/openai/protocol.py):
  {"type":"chat","model":...,"messages":[...],"max_tokens":...,"temperature":..., ...}
  {"type":"cancel"}
Server frames: {"type":"token","text":...} as tokens are produced, then
{"type":"done","finish_reason":"stop"|"length"|"cancelled","usage":{...}};
{"type":"error","code":...,"message":...,"param":...} for a bad frame, a refused request or a
generation that failed (its tokens so far are not a reply; code as the HTTP API's, see
frontend/openai/failures.py); the connection stays usable. Frames larger than the configured
cap close the socket with 1009; a disconnect aborts the running generation."""

from __future__ import annotations

import asyncio
import contextlib

from pydantic import TypeAdapter
from starlette.websockets import WebSocket, WebSocketDisconnect

from frontend.http.errors import ApiError
from frontend.http.request_body import parse_json, validate
from frontend.manager import Caller, FrontendManager
from frontend.openai.failures import failure
from frontend.openai.protocol import WsCancelFrame, WsChatFrame, WsFrame
from frontend.openai.responses import finish_reason
from frontend.tenancy.auth import Authenticator

POLICY_VIOLATION = 1008
FRAMES = TypeAdapter(WsFrame)


async def ws_chat(websocket: WebSocket, manager: FrontendManager, auth: Authenticator) -> None:
    try:
        tenant, key_hash = auth.tenant(websocket, allow_query=True)
    except ApiError:
        await websocket.close(code=POLICY_VIOLATION)  # before accept: the handshake gets 403
        return
    await websocket.accept()
    session = _Session(websocket, manager, Caller(tenant, key_hash))
    try:
        await session.run()
    finally:
        await session.stop()


class _Session:
    def __init__(self, websocket: WebSocket, manager: FrontendManager, caller: Caller) -> None:
        self.ws, self.manager, self.caller = websocket, manager, caller
        self.task: asyncio.Task | None = None

    async def run(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            try:
                frame = read_frame(message)
            except ApiError as exc:
                await self.send_error(exc)
                continue
            if isinstance(frame, WsCancelFrame):
                if self.task is not None and not self.task.done():
                    self.task.cancel()
            elif self.task is not None and not self.task.done():
                await self.send_error(
                    ApiError(409, "busy", "a reply is still streaming; cancel it first")
                )
            else:
                self.task = asyncio.create_task(self.chat(frame))

    async def chat(self, frame: WsChatFrame) -> None:
        m = self.manager
        streams: list = []
        generated, reason, prompt = 0, "cancelled", []
        try:
            adapter = await m.resolve_model(self.caller, frame.model)
            gen = await m.requests.chat(frame, adapter)
            prompt = gen.choices[0].prompt
            streams = await m.start(self.caller, gen)
            async for out in streams[0]:
                generated += len(out.new_token_ids)
                if out.new_text:
                    await self.ws.send_json({"type": "token", "text": out.new_text})
                if out.finished:
                    error = failure(out)
                    if error is not None:
                        raise error
                    reason = finish_reason(out)
        except ApiError as exc:
            await self.send_error(exc)
            return
        except asyncio.CancelledError:
            pass  # {"type":"cancel"} or the socket closed
        finally:
            if streams:
                await streams[0].aclose()
                m.release(self.caller, stream=True)
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": generated,
            "total_tokens": len(prompt) + generated,
        }
        done = {"type": "done", "finish_reason": reason, "usage": usage}
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):
            await self.ws.send_json(done)

    async def send_error(self, exc: ApiError) -> None:
        frame = {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param}
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):
            await self.ws.send_json(frame)

    async def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


def read_frame(message: dict) -> WsChatFrame | WsCancelFrame:
    """A client frame, or ApiError (code invalid_frame, unknown_type or the field's)."""
    raw = message.get("text")
    if raw is None and message.get("bytes") is not None:
        raw = message["bytes"].decode("utf-8", "replace")
    try:
        data = parse_json(raw or "")
    except ApiError as exc:
        raise ApiError(400, "invalid_frame", f"could not read the frame: {exc.message}") from None
    return validate(FRAMES, data, strip_tag=True)
