"""Serving /v1/completions and /v1/chat/completions: body -> GenerationRequest -> streams of
outputs -> one answer, or Server-Sent Events in the OpenAI chunk format ending in
`data: [DONE]`. Usage is reported (in the last chunk when `stream_options.include_usage` is
set). A client that disconnects, streaming or not, aborts its generations within one engine
step."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from frontend.http.request_body import read_json, validate
from frontend.manager import Caller, FrontendManager
from frontend.openai.failures import failure, first_failure
from frontend.openai.generation import GenerationRequest
from frontend.openai.protocol import ChatCompletionRequest, CompletionRequest
from frontend.openai.responses import ResponseBuilder, finish_reason
from punica_x.api import RequestOutput

_DONE = object()


def list_models(manager: FrontendManager, caller: Caller) -> JSONResponse:
    """OpenAI's model list; each entry also names the base model's family (an adapter's is
    its base model's), as `family`; the base model's entry says what its weights are served
    as and their bytes on one runner (`weight_format`, `weight_bytes`). As vLLM lists them,
    `root` (an adapter's: the path it was loaded from) and `parent` (an adapter's: the base
    model; the base model's: null)."""
    base = manager.model_id
    data = [
        {
            "id": mid,
            "object": "model",
            "created": int(created),
            "owned_by": "punica-x" if mid == base else caller.tenant.name,
            "root": root,
            "parent": None if mid == base else base,
            "family": manager.family,
            **(manager.weights if mid == base else {}),
        }
        for mid, created, root in manager.model_ids(caller)
    ]
    return JSONResponse({"object": "list", "data": data})


async def completions(manager: FrontendManager, caller: Caller, request: Request, chat: bool):
    data = await read_json(request, manager.limits.max_body_bytes)
    body = validate(ChatCompletionRequest if chat else CompletionRequest, data)
    adapter = await manager.resolve_model(caller, body.model)
    builder = manager.requests
    gen = await (builder.chat(body, adapter) if chat else builder.completion(body, adapter))
    streams = await manager.start(caller, gen)
    text_of = manager.token_text
    response = ResponseBuilder(gen, text_of, manager.tokenizer.decode)
    if gen.stream:
        return StreamingResponse(
            _sse(manager, caller, streams, response, gen),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        finals = await _until_done_or_disconnect(request, _collect(streams))
    finally:
        manager.release(caller, stream=False)
    if finals is None:  # the client went away; nobody reads this
        return JSONResponse({}, status_code=499)
    error = first_failure(finals)
    if error is not None:
        raise error
    return JSONResponse(response.full_response(finals))


async def _sse(manager, caller, streams, meta: ResponseBuilder, gen: GenerationRequest):
    try:
        if meta.chat:
            for i in range(len(streams)):
                yield _event(meta.chunk(i, None, None, first=True))
        generated = 0
        async for index, out in _merge(streams):
            error = failure(out) if out.finished else None
            if error is not None:  # the request fails: an error event, the other choices stop
                yield _event(error.body())
                break
            for event in _choice_events(meta, index, out):
                yield event
            generated += 0 if meta.score_only else len(out.new_token_ids)
        else:
            if gen.include_usage:
                usage = meta.usage(generated)
                yield _event({**meta.chunk(0, None, None), "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"
    finally:
        await _close_all(streams)
        manager.release(caller, stream=True)


def _choice_events(meta: ResponseBuilder, index: int, out: RequestOutput) -> list[str]:
    """The events of one output of choice `index`: under echo the prompt before its first
    token, the new text (and logprobs), the finish reason on the last one."""
    events = []
    if meta.echo and index not in meta.echoed and (out.new_token_ids or out.finished):
        meta.echoed.add(index)  # the prompt (and its logprobs) before the first token
        lp = meta.prompt_chunk_logprobs(out)
        events.append(_event(meta.chunk(index, meta.prompt_texts[index], None, logprobs=lp)))
    if meta.score_only:
        if out.finished:
            events.append(_event(meta.chunk(index, None, finish_reason(out))))
        return events
    lp = meta.logprobs(index, out, new_only=True) if out.new_token_ids else None
    if out.new_text or lp is not None:
        events.append(_event(meta.chunk(index, out.new_text, None, logprobs=lp)))
    if out.finished:
        events.append(_event(meta.chunk(index, None, finish_reason(out))))
    return events


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
