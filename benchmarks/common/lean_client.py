"""The cheapest honest reader of many SSE streams, for measuring a server whose clients share
its cores: each stream is one HTTP/1.1 request on a raw asyncio connection (Connection:
close), its body read to the end in large pieces and parsed once, at the end, for the usage
chunk (the server's count of the completion tokens it sent). No per-event parsing: on 2 cores
httpx's line iterator cost the client ~0.8 of a core at 256 streams, CPU the server lost."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

_USAGE = re.compile(rb'"usage":\s*\{[^}]*"completion_tokens":\s*(\d+)')


@dataclass(frozen=True)
class StreamRead:
    """One stream as the client saw it: perf_counter times of its request, of the first read
    holding an event and of its end; the completion tokens its usage reports; its events."""

    sent: float
    first: float
    end: float
    tokens: int
    events: int


async def lean_stream(host: str, port: int, key: str, body: dict) -> StreamRead:
    """One streamed completion read to its end. RuntimeError on a status other than 200 or
    a stream without its usage chunk or [DONE]."""
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    sent = time.perf_counter()
    first = None
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(head + payload)
        pieces = []
        while piece := await reader.read(1 << 16):
            if first is None and b"data: " in piece:
                first = time.perf_counter()
            pieces.append(piece)
    finally:
        writer.close()
    end = time.perf_counter()
    data = b"".join(pieces)
    status = data[: data.find(b"\r\n")]
    if b" 200 " not in status + b" ":
        raise RuntimeError(f"{status.decode(errors='replace')}: {data[-500:]!r}")
    found = _USAGE.findall(data[-4096:])
    if not found or b"data: [DONE]" not in data[-256:]:
        raise RuntimeError(f"a stream ended without its usage or [DONE]: {data[-500:]!r}")
    return StreamRead(sent, first or end, end, int(found[-1]), data.count(b"\ndata: ") + 1)


async def run_lean_clients(url: str, key: str, bodies: list[dict], clients: int):
    """`clients` connections at a time take the bodies in order; returns (seconds from the
    first request to the last stream's end, completion tokens the server reported, each
    stream's StreamRead)."""
    parts = urlsplit(url)
    queue: asyncio.Queue = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    reads: list[StreamRead] = []

    async def worker():
        while not queue.empty():
            reads.append(await lean_stream(parts.hostname, parts.port, key, queue.get_nowait()))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return time.perf_counter() - start, sum(r.tokens for r in reads), reads
