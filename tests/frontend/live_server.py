"""A real `punica-x serve` process on 127.0.0.1 (a subprocess), and helpers to talk to it."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

# A server that is still working (its log grows: a kernel build, a model conversion) is
# never killed for being slow; one silent this long, or past the cap, is.
SILENT_TIMEOUT = 180
READY_CAP = 1200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    data_dir: Path
    proc: subprocess.Popen
    model_id: str
    log: Path
    args: list = field(default_factory=list)

    @property
    def admin_token(self) -> str:
        return (self.data_dir / "admin_token").read_text().strip()

    def http(self, key: str | None = None, timeout: float = 60) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def create_tenant(self, name: str, **limits) -> str:
        with self.http(self.admin_token) as c:
            r = c.post("/admin/tenants", json={"name": name, **limits})
        assert r.status_code == 201, r.text
        return r.json()["api_key"]

    def upload(self, key: str, name: str, folder: Path) -> httpx.Response:
        files = {
            f: (f, (folder / f).read_bytes())
            for f in ("adapter_config.json", "adapter_model.safetensors")
        }
        with self.http(key) as c:
            return c.post("/v1/adapters", data={"name": name}, files=files)

    def metric(self, name: str, **labels) -> float:
        """Sum of the samples called `name` whose labels include `labels` (0 if none)."""
        from prometheus_client.parser import text_string_to_metric_families

        with self.http(self.admin_token) as c:
            text = c.get("/metrics").text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    def wait_idle(self, timeout: float = 20) -> None:
        """Until the runner holds no request and no KV block."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (
                self.metric("punica_x_kv_blocks_used") == 0
                and self.metric("punica_x_batch_size") == 0
                and self.metric("punica_x_queue_length") == 0
            ):
                return
            time.sleep(0.05)
        raise AssertionError("the runner did not become idle")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# The tight_server fixture's KV cache (8 blocks of 16 tokens) and websocket frame cap.
TIGHT_KV_TOKENS = 128
TIGHT_WS_FRAME_BYTES = 4096


def start_server(model_dir: Path | None, data_dir: Path, *extra: str) -> Server:
    """`punica-x serve` on a free port; model_dir None serves the default model.

    Serves float32 unless `extra` names `--dtype`: tests compare servers with each other and
    with float32 HF references, and `--dtype auto` is bfloat16 on CPUs with AVX512-BF16."""
    if "--dtype" not in extra:
        extra = (*extra, "--dtype", "float32")
    port = free_port()
    log = data_dir.parent / f"server-{port}.log"
    model = ["--model", str(model_dir)] if model_dir is not None else []
    cmd = [
        sys.executable,
        "-m",
        "frontend.cli",
        "serve",
        *model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
        *extra,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    name = model_dir.name if model_dir is not None else "SmolLM2-135M-Instruct"
    server = Server(f"http://127.0.0.1:{port}", data_dir, proc, name, log, list(extra))
    start = time.monotonic()
    quiet_since, size = start, 0
    while time.monotonic() - quiet_since < SILENT_TIMEOUT and time.monotonic() - start < READY_CAP:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(server.url + "/ready", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if log.stat().st_size != size:
            quiet_since, size = time.monotonic(), log.stat().st_size
        time.sleep(0.2)
    server.stop()
    waited = time.monotonic() - start
    raise RuntimeError(f"server not ready after {waited:.0f} s: {log.read_text()[-3000:]}")


def tar_gz(members: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
    return buf.getvalue()


def tenant_client(srv: Server, tenant: str, adapter: str, folder: Path):
    """The openai client of a new tenant `tenant` that uploaded `folder` as `adapter`."""
    import openai

    key = srv.create_tenant(tenant)
    assert srv.upload(key, adapter, folder).status_code == 201
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)
