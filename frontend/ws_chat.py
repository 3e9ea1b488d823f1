"""WS /v1/chat/ws: streaming chat over a websocket, several turns per connection.

The key is checked before the socket is accepted (Authorization header, or a `token` query
parameter for browsers; it is never logged). Client frames:
  {"type":"chat","model":...,"messages":[...],"max_tokens":...,"temperature":...}
  {"type":"cancel"}
Server frames: {"type":"token","text":...} as tokens are produced, then
{"type":"done","finish_reason":...,"usage":{...}}; {"type":"error","code":...,"message":...}
for a bad frame or a refused request (the connection stays usable). Frames larger than the
configured cap close the socket with 1009; a disconnect aborts the running generation."""

from __future__ import annotations

import asyncio
import contextlib
import json

from starlette.websockets import WebSocket, WebSocketDisconnect

from frontend.auth import Authenticator
from frontend.errors import ApiError
from frontend.manager import Caller, FrontendManager

POLICY_VIOLATION = 1008


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
            raw = message.get("text")
            if raw is None and message.get("bytes") is not None:
                raw = message["bytes"].decode("utf-8", "replace")
            try:
                frame = json.loads(raw or "")
                if not isinstance(frame, dict):
                    raise ValueError("a frame must be a JSON object")
            except ValueError as exc:
                await self.send_error("invalid_frame", f"could not read the frame: {exc}")
                continue
            kind = frame.get("type")
            if kind == "chat":
                if self.task is not None and not self.task.done():
                    await self.send_error("busy", "a reply is still streaming; cancel it first")
                else:
                    self.task = asyncio.create_task(self.chat(frame))
            elif kind == "cancel":
                if self.task is not None and not self.task.done():
                    self.task.cancel()
            else:
                await self.send_error(
                    "unknown_type", f"unknown frame type {kind!r} (chat or cancel)"
                )

    async def chat(self, frame: dict) -> None:
        m = self.manager
        stream = None
        admitted = False
        generated, reason, prompt = 0, "cancelled", []
        try:
            adapter = m.resolve_model(self.caller, frame.get("model"))
            prompt = m.encode_chat(frame.get("messages"))
            sampling = m.sampling(frame, len(prompt))
            m.admit(self.caller, stream=True)
            admitted = True
            stream = await m.open(self.caller, frame["model"], adapter, prompt, sampling)
            async for out in stream:
                generated += len(out.new_token_ids)
                if out.new_text:
                    await self.ws.send_json({"type": "token", "text": out.new_text})
                if out.finished:
                    reason = out.finish_reason.value if out.finish_reason else "stop"
        except ApiError as exc:
            await self.send_error(exc.code, exc.message)
            return
        except asyncio.CancelledError:
            pass  # {"type":"cancel"} or the socket closed
        finally:
            if stream is not None:
                await stream.aclose()
            if admitted:
                m.release(self.caller, stream=True)
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": generated,
            "total_tokens": len(prompt) + generated,
        }
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):
            await self.ws.send_json({"type": "done", "finish_reason": reason, "usage": usage})

    async def send_error(self, code: str, message: str) -> None:
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):
            await self.ws.send_json({"type": "error", "code": code, "message": message})

    async def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
