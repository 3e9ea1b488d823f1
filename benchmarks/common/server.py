"""`punica-x serve` for the HTTP benchmarks: on a free port of 127.0.0.1, with a tenant
holding the benchmark's adapters; stopped when the benchmark is done with it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    data_dir: Path,
    port: int,
    extra: tuple[str, ...] = (),
    engine_threads: int | None = None,
    ready_s: float = 300,
) -> subprocess.Popen:
    """The server on 127.0.0.1:port; engine_threads: torch threads of its engine (thread
    runners: the server process's OMP_NUM_THREADS; Ray runners: PUNICA_X_RUNNER_THREADS);
    ready_s: how long it may take to answer /ready (its log is appended to, across starts)."""
    log = (data_dir.parent / "server.log").open("a")
    env = dict(os.environ)
    if engine_threads:
        env["OMP_NUM_THREADS"] = env["PUNICA_X_RUNNER_THREADS"] = str(engine_threads)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "frontend.cli",
            "serve",
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    return wait_ready(
        proc, f"http://127.0.0.1:{port}/ready", ready_s, data_dir.parent / "server.log"
    )


def wait_ready(proc: subprocess.Popen, url: str, seconds: float, log: Path) -> subprocess.Popen:
    """proc once GET url answers 200 (polled twice a second, also while it answers 503: a
    tighter poll steals the loading server's cores); RuntimeError naming the log if the
    process exits (punica-x does when its model cannot be built), its /ready reports that
    loading failed (the body's "error") or `seconds` pass first (the process is killed
    then)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited ({proc.returncode}); see {log}")
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200:
                return proc
            error = _load_error(r)
            if error:
                proc.kill()
                raise RuntimeError(f"the server could not load: {error}; see {log}")
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{proc.args[0]} was not ready after {seconds:g} s; see {log}")


def _load_error(r: httpx.Response) -> str | None:
    try:
        body = r.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    # punica-x says why loading failed in a string; llama.cpp's 503 while it is still
    # loading carries {"message": "Loading model", ...}
    return error if isinstance(error, str) else None


@contextlib.contextmanager
def bench_server(
    tmp: Path, paths: list[Path], extra: tuple[str, ...] = (), engine_threads: int | None = None
):
    """A server on a free port and a tenant holding the adapters a0..: yields (server, url,
    tenant key, base model id); the server is stopped on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(tmp / "data", port, extra, engine_threads)
    try:
        key, model_id = setup_tenant(url, tmp / "data", paths)
        yield server, url, key, model_id
    finally:
        server.terminate()
        server.wait(30)


def setup_tenant(url: str, data_dir: Path, paths: list[Path]) -> tuple[str, str]:
    """A tenant with the adapters a0..a{n-1} uploaded; returns (its key, the base model id)."""
    token = (data_dir / "admin_token").read_text().strip()
    admin = {"Authorization": f"Bearer {token}"}
    key = httpx.post(url + "/admin/tenants", json={"name": "bench"}, headers=admin).json()[
        "api_key"
    ]
    auth = {"Authorization": f"Bearer {key}"}
    for i, p in enumerate(paths):
        files = {
            f: (f, (p / f).read_bytes())
            for f in ("adapter_config.json", "adapter_model.safetensors")
        }
        r = httpx.post(
            url + "/v1/adapters", data={"name": f"a{i}"}, files=files, headers=auth, timeout=60
        )
        r.raise_for_status()
    return key, httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"]
