"""bench_quant's peer plumbing that runs without llama.cpp: the per-request LoRA field, the
build's ISA, the readiness wait, and adapters written from a model's shapes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from common import llama_cpp  # noqa: E402
from common.server import wait_ready  # noqa: E402
from common.workload import random_adapters  # noqa: E402


def test_lora_body_picks_one_adapter_at_scale_one():
    assert llama_cpp.lora_body(None, 0) == {}
    assert llama_cpp.lora_body(None, 4) == {"lora": []}  # the base model: every scale 0
    assert llama_cpp.lora_body(3, 4) == {"lora": [{"id": 3, "scale": 1.0}]}


def test_the_peer_is_built_for_the_isa_our_kernels_are_held_to(monkeypatch):
    monkeypatch.delenv("PUNICA_X_CPU_ISA", raising=False)
    assert llama_cpp.build_isa() == "native"
    monkeypatch.setenv("PUNICA_X_CPU_ISA", "avx2")
    assert llama_cpp.build_isa() == "avx2"
    assert "-DGGML_AVX512=OFF" in llama_cpp.ISA_FLAGS["avx2"]


def test_a_server_that_exits_is_reported_with_its_log(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match=r"exited \(3\); see .*peer\.log"):
        wait_ready(proc, "http://127.0.0.1:9/health", 30, tmp_path / "peer.log")


def test_a_server_whose_load_failed_is_reported_at_once(tmp_path):
    """punica-x stays up after a failed load, its /ready saying why (503 with "error"):
    waiting out the timeout there cost a lent GPU's check 2.5 minutes."""
    script = (
        "import json, sys\n"
        "from http.server import BaseHTTPRequestHandler, HTTPServer\n"
        "class H(BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        err = 'ImportError: no flashinfer'\n"
        "        body = json.dumps({'status': 'not_ready', 'error': err})\n"
        "        self.send_response(503); self.end_headers(); self.wfile.write(body.encode())\n"
        "    def log_message(self, *a): pass\n"
        "s = HTTPServer(('127.0.0.1', 0), H)\n"
        "print(s.server_port, flush=True)\n"
        "s.serve_forever()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    try:
        with pytest.raises(RuntimeError, match="could not load: ImportError: no flashinfer"):
            wait_ready(proc, f"http://127.0.0.1:{port}/ready", 60, tmp_path / "server.log")
        assert proc.wait(10) is not None  # killed
    finally:
        proc.kill()


def test_random_adapters_load_into_the_model_they_were_shaped_for(tiny_model_dir, tmp_path):
    from helpers import tiny_llm

    paths = random_adapters(tiny_model_dir, 2, 4, tmp_path / "adapters")
    llm = tiny_llm(tiny_model_dir)
    for i, p in enumerate(paths):
        llm.load_adapter(f"a{i}", str(p))
    outs = llm.generate(["hello"] * 2, ["a0", "a1"])
    assert outs[0].token_ids and outs[1].token_ids


def test_a_peer_still_loading_is_waited_for_not_failed():
    """llama.cpp's /health answers 503 with an "error" object while it loads the model (a
    bench once gave up on that); punica-x's /ready names a failed load in a string."""
    import httpx
    from common.server import _load_error

    loading = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
    assert _load_error(httpx.Response(503, json=loading)) is None
    failed = {"status": "not_ready", "error": "ImportError: no flashinfer"}
    assert _load_error(httpx.Response(503, json=failed)) == "ImportError: no flashinfer"
    assert _load_error(httpx.Response(503, text="not json")) is None
