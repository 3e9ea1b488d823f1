"""The fault campaign's clients (bench_faults.py): completions against a live server, each one
recorded with what the client saw, and judged against the text of a fault-free run.

Outcomes: "ok" (the reference text), "failed" (a visible error: a 5xx with an error body
naming the failure, or an error event in the stream), "refused" (4xx/503 before anything was
generated: admission), and the four that must never happen: "lost" (no answer within the
timeout, or a stream that ended without [DONE] or an error), "broken" (the connection broke or
the server answered 500 internal_error: an exception reached the request's handler),
"truncated" (no error, but a strict prefix of the reference), "wrong" (no error, another
text)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

BAD = ("lost", "broken", "truncated", "wrong")
TIMEOUT_S = 180.0  # a request with no answer by then is lost (a SIGSTOP lasts 10 s)


@dataclass(frozen=True)
class Spec:
    """One request of the pool: its tenant (index), model, prompt, length and whether it
    streams."""

    tenant: int
    model: str
    prompt: str
    max_tokens: int
    stream: bool
    long: bool = False  # more KV than one runner holds (DistKV borrows the rest)

    def body(self) -> dict:
        return {"model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": self.stream}  # fmt: skip


@dataclass
class Record:
    """What one request's client saw."""

    spec: int  # its index in the pool
    started: float
    ended: float = 0.0
    status: int = 0
    text: str = ""
    error: str | None = None
    outcome: str = ""
    # a streamed request's text chunks as they came ([seconds since it started, text]); the
    # reference text, for one that did not end ok (kept in the JSON to tell what went wrong)
    events: list = field(default_factory=list)
    reference: str = ""


async def complete(client: httpx.AsyncClient, key: str, spec: Spec, index: int) -> Record:
    """Send one request; the Record of what came back (outcome not judged yet)."""
    rec = Record(index, time.monotonic())
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with asyncio.timeout(TIMEOUT_S):
            if spec.stream:
                await _streamed(client, headers, spec, rec)
            else:
                r = await client.post("/v1/completions", json=spec.body(), headers=headers)
                rec.status = r.status_code
                body = r.json()
                if r.status_code == 200:
                    rec.text = body["choices"][0]["text"]
                else:
                    rec.error = body.get("error", {}).get("code", r.text[:200])
    except TimeoutError:
        rec.error = "timeout"
        rec.status = -1
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
        rec.status = rec.status or -2
    rec.ended = time.monotonic()
    return rec


async def _streamed(client, headers, spec: Spec, rec: Record) -> None:
    async with client.stream("POST", "/v1/completions", json=spec.body(), headers=headers) as r:
        rec.status = r.status_code
        if r.status_code != 200:
            body = json.loads(await r.aread())
            rec.error = body.get("error", {}).get("code", str(body)[:200])
            return
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                rec.error = event["error"].get("code", "error")
            elif event.get("choices"):
                piece = event["choices"][0].get("text", "")
                rec.text += piece
                rec.events.append([round(time.monotonic() - rec.started, 2), piece])
        if not done and rec.error is None:
            rec.status = -3  # the stream ended without [DONE] or an error


def judge(rec: Record, reference: str) -> str:
    """The outcome of a request whose fault-free text is `reference`."""
    if rec.status == -1 or rec.status == -3:
        return "lost"
    if rec.status == -2 or rec.error == "internal_error":
        return "broken"
    if rec.error is not None:
        if rec.status in (429, 503, 400, 413) and not rec.text:
            return "refused"
        return "failed"
    if rec.status != 200:
        return "lost"
    if rec.text == reference:
        return "ok"
    if reference.startswith(rec.text):
        return "truncated"
    return "wrong"
