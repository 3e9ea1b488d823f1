"""The faults bench_faults.py injects into a live `punica-x serve` with Ray runners, each an
async function of the campaign (its server URL, admin token, tenants, data folder) that
returns what it hit, or None where nothing of its kind was there to hit (then another kind
is drawn):

- runner / model_worker: SIGKILL of a Ray runner's process (under Lamina: a model worker);
- attention_worker: SIGKILL of one of a Lamina runner's attention workers;
- distkv_lender: SIGKILL of a runner lending KV blocks to a peer's request (DistKV);
- sigstop: SIGSTOP of a runner's process for STOP_S seconds, then SIGCONT;
- disk_full: the data folder's file system filled (a tmpfs the campaign mounted) while a
  tenant uploads an adapter: 507 expected, then the upload once space is back: 201;
- slow_client: a client that opens a long stream and stops reading for STALL_S seconds."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

STOP_S = 10.0
STALL_S = 15.0


@dataclass
class Campaign:
    url: str
    admin: str  # the admin token
    keys: list[str]  # the tenants' API keys
    models: list[list[str]]  # per tenant: the models it asks for (its adapters, the base)
    data_dir: Path
    adapter_dir: Path  # an adapter to upload (disk_full)
    tmpfs: bool  # the data folder is a tmpfs of its own (disk_full can fill it)
    rng: random.Random


async def runners(c: Campaign) -> list[dict]:
    async with httpx.AsyncClient(base_url=c.url, timeout=10) as h:
        r = await h.get("/admin/runners", headers={"Authorization": f"Bearer {c.admin}"})
    return [row for row in r.json()["runners"] if row["state"] == "active" and row["pid"]]


async def kill_runner(c: Campaign) -> str | None:
    rows = await runners(c)
    if not rows:
        return None
    row = max(rows, key=lambda r: (r["running"], c.rng.random()))
    os.kill(row["pid"], signal.SIGKILL)
    return f"{row['id']} (pid {row['pid']}, {row['running']} running)"


async def kill_attention_worker(c: Campaign) -> str | None:
    rows = [r for r in await runners(c) if r["attention_workers"]]
    if not rows:
        return None
    row = c.rng.choice(rows)
    worker = c.rng.choice(row["attention_workers"])
    os.kill(worker["pid"], signal.SIGKILL)
    return f"{row['id']} attention worker {worker['index']} (pid {worker['pid']})"


async def kill_lender(c: Campaign) -> str | None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lenders = [r for r in await runners(c) if r["kv_blocks_lent"] > 0]
        if lenders:
            row = c.rng.choice(lenders)
            os.kill(row["pid"], signal.SIGKILL)
            return f"{row['id']} (pid {row['pid']}, {row['kv_blocks_lent']} blocks lent)"
        await asyncio.sleep(0.5)
    return None


async def stop_runner(c: Campaign) -> str | None:
    rows = await runners(c)
    if not rows:
        return None
    row = c.rng.choice(rows)
    os.kill(row["pid"], signal.SIGSTOP)
    try:
        await asyncio.sleep(STOP_S)
    finally:
        os.kill(row["pid"], signal.SIGCONT)
    return f"{row['id']} (pid {row['pid']}) stopped {STOP_S:g} s"


async def fill_disk(c: Campaign) -> str | None:
    if not c.tmpfs:
        return None
    filler = c.data_dir / "filler"
    with filler.open("wb") as f:  # until the file system is full
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    try:
        full = await _upload(c)
    finally:
        filler.unlink()
    after = await _upload(c)
    return f"upload while full: {full}, after: {after}"


async def _upload(c: Campaign) -> int:
    files = {
        f: (f, (c.adapter_dir / f).read_bytes())
        for f in ("adapter_config.json", "adapter_model.safetensors")
    }
    async with httpx.AsyncClient(base_url=c.url, timeout=60) as h:
        r = await h.post(
            "/v1/adapters",
            data={"name": "disk-full-probe"},
            files=files,
            headers={"Authorization": f"Bearer {c.keys[0]}"},
        )
    return r.status_code


async def stall_client(c: Campaign) -> str | None:
    host, port = c.url.removeprefix("http://").split(":")
    body = json.dumps(
        {"model": c.models[0][0], "prompt": "a client that stops reading", "max_tokens": 400,
         "temperature": 0, "ignore_eos": True, "stream": True}
    ).encode()  # fmt: skip
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {c.keys[0]}"
        f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.sendall(head + body)
        await asyncio.to_thread(sock.recv, 512)  # the headers, a first event; then nothing
        await asyncio.sleep(STALL_S)
    finally:
        sock.close()
    return f"read 512 bytes, then stalled {STALL_S:g} s and closed"


KINDS = {
    "runner": kill_runner,
    "model_worker": kill_runner,
    "attention_worker": kill_attention_worker,
    "distkv_lender": kill_lender,
    "sigstop": stop_runner,
    "disk_full": fill_disk,
    "slow_client": stall_client,
}
