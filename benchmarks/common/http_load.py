"""A closed-loop load of OpenAI completions requests against any server (punica-x,
llama.cpp's, vLLM's): `clients` concurrent connections take jobs from a queue until it is
empty; each job is (model, prompt, extra body fields). Requests are not streamed (each
server's own accounting of completion tokens is read from `usage`), greedy, EOS ignored."""

from __future__ import annotations

import asyncio
import time

import httpx


async def _run(url: str, key: str, jobs: list, clients: int, max_tokens: int) -> tuple:
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    tokens = [0]
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=900) as c:

        async def worker():
            while not queue.empty():
                model, prompt, extra = queue.get_nowait()
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    **extra,
                }
                r = await c.post("/v1/completions", json=body)
                r.raise_for_status()
                tokens[0] += r.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return time.perf_counter() - start, tokens[0]


def tokens_per_second(url: str, key: str, jobs: list, clients: int, max_tokens: int) -> float:
    """Generated tokens per second of the whole load (first request sent to last answer)."""
    elapsed, tokens = asyncio.run(_run(url, key, jobs, clients, max_tokens))
    if tokens != len(jobs) * max_tokens:
        raise RuntimeError(f"{tokens} tokens generated, {len(jobs) * max_tokens} asked for")
    return tokens / elapsed
