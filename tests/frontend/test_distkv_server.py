"""DistKV through the HTTP API: `serve --runners 2` with caches too small for a long prompt
serves it by borrowing blocks on the peer (greedy output equal to the one-runner server with a
large cache), refuses one beyond the cluster with 400 context_length_exceeded naming the
cluster's limit, and `--no-distkv` refuses what one runner cannot hold."""

from __future__ import annotations

import pytest
from live_server import start_server

from scheduler.distkv.network import default_caps

BLOCK_BYTES = 8192  # one float32 KV block (16 tokens) of the tiny model
RUNNER_BLOCKS = 8  # 128 tokens a runner
# A runner's own blocks plus what its peer lends by default
CLUSTER_TOKENS = (RUNNER_BLOCKS + default_caps(RUNNER_BLOCKS).max_blocks) * 16
LONG = [3 + (7 * i) % 300 for i in range(150)]  # more than one runner's 128 tokens


def _start(srv_model_dir, tmp_path_factory, name: str, *extra: str):
    data = tmp_path_factory.mktemp(name) / "data"
    cache = str(RUNNER_BLOCKS * BLOCK_BYTES)
    return start_server(srv_model_dir, data, "--runners", "2", "--kv-cache-bytes", cache, *extra)


@pytest.fixture(scope="module")
def distkv_server(srv_model_dir, tmp_path_factory):
    srv = _start(srv_model_dir, tmp_path_factory, "distkv")
    yield srv
    srv.stop()


def complete(srv, key: str, prompt: list[int], max_tokens: int):
    body = {"model": srv.model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body["ignore_eos"] = True
    with srv.http(key, timeout=300) as c:
        return c.post("/v1/completions", json=body)


def test_a_prompt_no_runner_holds_is_served_across_both(distkv_server, server):
    expected = complete(server, server.create_tenant("distkv-ref"), LONG, 64)
    assert expected.status_code == 200, expected.text
    got = complete(distkv_server, distkv_server.create_tenant("distkv"), LONG, 64)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == expected.json()["choices"][0]["text"]
    assert got.json()["usage"]["completion_tokens"] == 64
    distkv_server.wait_idle()
    with distkv_server.http(distkv_server.admin_token) as c:
        rows = c.get("/admin/runners").json()["runners"]
    assert [(r["kv_blocks_lent"], r["kv_blocks_borrowed"]) for r in rows] == [(0, 0), (0, 0)]
    assert distkv_server.metric("punica_x_kv_blocks_free") == 2 * RUNNER_BLOCKS
    # the debtor's micro-attention calls to its peer: one per layer of every step after the
    # prompt's first 128 tokens (the tiny model has 2 layers), and their round trips
    borrower = max(rows, key=lambda r: r["remote_attention_calls"])
    assert borrower["remote_attention_calls"] >= 2 * 64
    assert sum(r["remote_attention_calls"] for r in rows) == borrower["remote_attention_calls"]
    calls = distkv_server.metric("punica_x_remote_attention_seconds_count", runner=borrower["id"])
    seconds = distkv_server.metric("punica_x_remote_attention_seconds_sum", runner=borrower["id"])
    assert calls == borrower["remote_attention_calls"] and 0 < seconds < 60


def test_a_prompt_beyond_the_cluster_is_refused_naming_its_limit(distkv_server):
    key = distkv_server.create_tenant("distkv-too-long")
    r = complete(distkv_server, key, [5] * (CLUSTER_TOKENS + 10), 4)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"the cluster's KV caches (DistKV) hold {CLUSTER_TOKENS}" in error["message"]


def test_without_distkv_one_runner_is_the_limit(srv_model_dir, tmp_path_factory):
    srv = _start(srv_model_dir, tmp_path_factory, "no-distkv", "--no-distkv")
    try:
        r = complete(srv, srv.create_tenant("no-distkv"), LONG, 4)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert f"the KV cache holds {RUNNER_BLOCKS * 16}" in error["message"]
    finally:
        srv.stop()
