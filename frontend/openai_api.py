"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

`model` is the base model id or one of the caller's adapters. `stream: true` answers with
Server-Sent Events in the OpenAI chunk format ending in `data: [DONE]`; usage is reported
(in the last chunk when `stream_options.include_usage` is set). A client that disconnects,
streaming or not, aborts its generations within one engine step."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from frontend.errors import ApiError, bad_request
from frontend.logprobs_format import TokenText, chat_logprobs, completion_logprobs
from frontend.manager import Caller, FrontendManager
from punica_x.core import RequestOutput, SamplingParams

_DONE = object()


async def read_json(request: Request, limit: int) -> dict:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, "payload_too_large", f"the request body exceeds {limit} bytes")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, "payload_too_large", f"the request body exceeds {limit} bytes")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request("invalid_json", f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("invalid_json", "the body must be a JSON object")
    return data


def list_models(manager: FrontendManager, caller: Caller) -> JSONResponse:
    data = [
        {
            "id": mid,
            "object": "model",
            "created": int(created),
            "owned_by": "punica-x" if mid == manager.model_id else caller.tenant.name,
        }
        for mid, created in manager.model_ids(caller)
    ]
    return JSONResponse({"object": "list", "data": data})


async def completions(manager: FrontendManager, caller: Caller, request: Request, chat: bool):
    body = await read_json(request, manager.limits.max_body_bytes)
    model = body.get("model")
    adapter = manager.resolve_model(caller, model)
    if chat:
        prompts = [manager.encode_chat(body.get("messages"))]
        max_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    else:
        prompts = [manager.encode_text(p) for p in _prompt_list(body.get("prompt"))]
        max_field = "max_tokens"
    n = manager.n_choices(body)
    api = "chat" if chat else "completions"
    params = [manager.sampling(body, len(p), max_field, api) for p in prompts]
    echo = not chat and body.get("echo") is True
    texts = [p if isinstance(p, str) else None for p in _raw_prompts(body, chat)]
    stream = bool(body.get("stream", False))
    include_usage = (
        bool((body.get("stream_options") or {}).get("include_usage")) if stream else True
    )
    manager.admit(caller, stream)
    streams: list[AsyncIterator[RequestOutput]] = []
    try:
        for prompt, sp in zip(prompts, params):
            for j in range(n):
                seeded = sp if sp.seed is None or j == 0 else _reseed(sp, sp.seed + j)
                streams.append(await manager.open(caller, model, adapter, prompt, seeded))
    except BaseException:
        await _close_all(streams)
        manager.release(caller, stream)
        raise
    meta = _Meta(
        chat,
        model,
        sum(len(p) * n for p in prompts),
        TokenText(manager.tokenizer),
        echo=echo,
        score_only=echo and body.get("max_tokens") == 0,
        prompt_texts=[
            t if t is not None else manager.tokenizer.decode(p)
            for p, t in zip(prompts, texts)
            for _ in range(n)
        ],
    )
    if stream:
        return StreamingResponse(
            _sse(manager, caller, streams, meta, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        finals = await _until_done_or_disconnect(request, _collect(streams))
    finally:
        manager.release(caller, stream)
    if finals is None:  # the client went away; nobody reads this
        return JSONResponse({}, status_code=499)
    return JSONResponse(meta.full_response(finals))


class _Meta:
    def __init__(
        self,
        chat: bool,
        model: str,
        prompt_tokens: int,
        text_of: TokenText,
        echo: bool = False,
        score_only: bool = False,
        prompt_texts: list[str] | None = None,
    ) -> None:
        """echo, score_only (echo with max_tokens 0): completions only; prompt_texts: the
        prompt's text per choice index (what echo returns)."""
        self.chat, self.model, self.prompt_tokens = chat, model, prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text_of, self.echo, self.score_only = text_of, echo, score_only
        self.prompt_texts = prompt_texts or []
        self._offsets: dict[int, int] = {}  # streaming: text offset of a choice's next token

    def completion_text(self, index: int, out: RequestOutput) -> str:
        prefix = self.prompt_texts[index] if self.echo else ""
        return prefix + ("" if self.score_only else out.text)

    def logprobs(self, index: int, out: RequestOutput, new_only: bool = False) -> dict | None:
        """The choice's logprobs object for `out` (its new tokens only when streaming)."""
        if out.logprobs is None:
            return None
        entries = out.new_logprobs if new_only else out.logprobs
        if self.chat:
            return chat_logprobs(self.text_of, entries)
        ids = out.new_token_ids if new_only else out.token_ids
        if self.score_only:
            ids, entries = [], []
        offset = 0
        if new_only:  # offsets continue across a choice's chunks
            start = len(self.prompt_texts[index]) if self.echo else 0
            offset = self._offsets.get(index, start)
            self._offsets[index] = offset + sum(len(self.text_of(t)) for t in ids)
        if self.echo and not new_only:
            ids = list(out.prompt_token_ids) + list(ids)
            entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + list(
                entries
            )
        return completion_logprobs(self.text_of, ids, entries, offset)

    def prompt_chunk_logprobs(self, out: RequestOutput) -> dict | None:
        """Streaming with echo: the prompt's logprobs, sent with the echoed prompt."""
        if out.logprobs is None:
            return None
        entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        return completion_logprobs(self.text_of, out.prompt_token_ids, entries, 0)

    def completion_tokens(self, outs) -> int:
        return 0 if self.score_only else sum(len(o.token_ids) for o in outs)

    def usage(self, completion_tokens: int) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def full_response(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for i, out in enumerate(finals):
            reason = _finish_reason(out)
            if self.chat:
                choices.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": out.text},
                        "logprobs": self.logprobs(i, out),
                        "finish_reason": reason,
                    }
                )
            else:
                choices.append(
                    {
                        "index": i,
                        "text": self.completion_text(i, out),
                        "logprobs": self.logprobs(i, out),
                        "finish_reason": reason,
                    }
                )
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(self.completion_tokens(finals)),
        }

    def chunk(
        self,
        index: int,
        text: str | None,
        reason: str | None,
        first: bool = False,
        logprobs: dict | None = None,
    ) -> dict:
        if self.chat:
            delta = (
                {"role": "assistant", "content": ""}
                if first
                else ({"content": text} if text else {})
            )
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            obj = "chat.completion.chunk"
        else:
            choice = {
                "index": index,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": reason,
            }
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }


def _finish_reason(out: RequestOutput) -> str:
    if out.finish_reason is None:
        return "stop"
    return {"stop": "stop", "length": "length"}.get(
        out.finish_reason.value, out.finish_reason.value
    )


async def _sse(manager: FrontendManager, caller: Caller, streams, meta: _Meta, include_usage: bool):
    generated = 0
    try:
        if meta.chat:
            for i in range(len(streams)):
                yield _event(meta.chunk(i, None, None, first=True))
        echoed: set[int] = set()
        async for index, out in _merge(streams):
            if meta.echo and index not in echoed and (out.new_token_ids or out.finished):
                echoed.add(index)  # the prompt (and its logprobs) before the first token
                text = meta.prompt_texts[index]
                yield _event(
                    meta.chunk(index, text, None, logprobs=meta.prompt_chunk_logprobs(out))
                )
            if meta.score_only:
                if out.finished:
                    yield _event(meta.chunk(index, None, _finish_reason(out)))
                continue
            generated += len(out.new_token_ids)
            if out.new_text or out.new_token_ids or out.finished:
                reason = _finish_reason(out) if out.finished else None
                lp = meta.logprobs(index, out, new_only=True) if out.new_token_ids else None
                if out.new_text or lp is not None:
                    yield _event(meta.chunk(index, out.new_text, None, logprobs=lp))
                if reason:
                    yield _event(meta.chunk(index, None, reason))
        if include_usage:
            usage = {**meta.chunk(0, None, None), "choices": [], "usage": meta.usage(generated)}
            yield _event(usage)
        yield "data: [DONE]\n\n"
    finally:
        await _close_all(streams)
        manager.release(caller, True)


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _merge(streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as their outputs arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async for out in s:
                await queue.put((i, out))
        finally:
            await queue.put((i, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out = await queue.get()
            if out is _DONE:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(streams) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for i, out in _merge(streams):
            if out.finished:
                finals[i] = out
    finally:
        await _close_all(streams)
    return finals


async def _close_all(streams) -> None:
    for s in streams:
        await s.aclose()


async def _until_done_or_disconnect(request: Request, coro):
    """Run coro; if the client disconnects first, cancel it (aborting the generations)."""
    work = asyncio.ensure_future(coro)

    async def disconnected():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return None
    finally:
        watcher.cancel()


def _raw_prompts(body: dict, chat: bool) -> list:
    """The prompts as the client sent them (strings or token-id lists); chat: one, no text."""
    return [None] if chat else _prompt_list(body.get("prompt"))


def _prompt_list(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if (
        isinstance(prompt, list)
        and prompt
        and len(prompt) <= 16
        and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p))
            for p in prompt
        )
    ):
        return list(prompt)
    raise bad_request(
        "invalid_prompt",
        "prompt must be a string, a list of token ids, or a list (up to 16) of those",
        "prompt",
    )


def _reseed(sp: SamplingParams, seed: int) -> SamplingParams:
    return replace(sp, seed=seed)
