"""bench_serve's streaming clients on the OpenAI completions route, greedy with EOS ignored:
the official openai client (closed loop: `clients` connections take jobs from a queue,
stamping time to first token and the gaps between tokens), a minimal SSE client on httpx
(one json.loads per event) on the same jobs, and Poisson arrivals at a rate (open loop).
Each job is (model, prompt[, extra body fields]). Beside them: the CPU seconds a process has
used, to tell the clients' share of the shared cores from the server's."""

from __future__ import annotations

import asyncio
import json
import os
import random
import resource
import time
from pathlib import Path

import httpx

from common.timing import latency_ms


async def run_clients(
    url: str, key: str, jobs: list[tuple[str, str]], clients: int, max_tokens: int
):
    """The official openai client's streams; returns (seconds, generated tokens as the server
    counts them, times to first token, inter-token gaps)."""
    import openai

    client = openai.AsyncOpenAI(
        base_url=url + "/v1",
        api_key=key,
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(
            limits=httpx.Limits(max_connections=clients + 4)
        ),
    )
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    ttft, itl, tokens = [], [], [0]

    async def worker():
        while not queue.empty():
            model, prompt, *extra = queue.get_nowait()
            last = time.perf_counter()
            first = True
            stream = await client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, **(extra[0] if extra else {})},
            )
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].text:
                    (ttft if first else itl).append(now - last)
                    first, last = False, now
                if chunk.usage:
                    tokens[0] += chunk.usage.completion_tokens

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    elapsed = time.perf_counter() - start
    await client.close()
    return elapsed, tokens[0], ttft, itl


async def run_raw_clients(
    url: str, key: str, jobs: list[tuple[str, str]], clients: int, max_tokens: int
):
    """The same streams read by a minimal SSE client; returns (seconds, generated tokens)."""
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    tokens = [0]
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=300) as http:

        async def worker():
            while not queue.empty():
                model, prompt = queue.get_nowait()
                body = stream_body(model, prompt, max_tokens, usage=True)
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            usage = json.loads(line[6:]).get("usage")
                            if usage:
                                tokens[0] += usage["completion_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return time.perf_counter() - start, tokens[0]


def stream_body(model: str, prompt, max_tokens: int, usage: bool = False) -> dict:
    """A streamed greedy completion's body (ignore_eos: every request makes max_tokens);
    usage: ask for the usage chunk at the end."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


def cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds (user + system) used so far by this process, or by process `pid`."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def open_loop_rate(
    url: str, key: str, jobs: list, rate: float, max_tokens: int, rng: random.Random
) -> dict:
    """Every job once, arriving as a Poisson process of `rate` requests/s; each is read by a
    minimal SSE client (one json.loads per event), stamping its tokens."""
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=len(jobs) + 4)
    ttft, itl, tokens = [], [], [0]
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=600) as http:

        async def one(model, prompt):
            body = stream_body(model, prompt, max_tokens)
            last = start = time.perf_counter()
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        now = time.perf_counter()
                        (ttft if last == start else itl).append(now - last)
                        last = now
                        tokens[0] += 1

        start = time.perf_counter()
        tasks = []
        for model, prompt in jobs:
            tasks.append(asyncio.create_task(one(model, prompt)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return {
        "rate": rate,
        "tok_s": tokens[0] / elapsed,
        **latency_ms(ttft, itl),
    }
