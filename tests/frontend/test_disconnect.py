"""A client that disconnects (SSE or plain) aborts its request within a step or two, at the
engine: the runner counts an abort (a reply run to its end would not), and its batch slot and
KV blocks return to their idle values."""

from __future__ import annotations

import json
import socket
import time


def test_sse_disconnect_aborts(server):
    key = server.create_tenant("sse-quitter")
    server.wait_idle()
    before = server.metric("punica_x_requests_total", tenant="sse-quitter", status="abort")
    aborted = server.metric("punica_x_engine_aborts_total")
    with (
        server.http(key) as c,
        c.stream(
            "POST",
            "/v1/completions",
            json={
                "model": server.model_id,
                "prompt": "hello",
                "max_tokens": 3000,
                "ignore_eos": True,
                "stream": True,
            },
        ) as r,
    ):
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                # leaving this loop drops the line iterator, which closes the connection
                assert server.metric("punica_x_kv_blocks_used") > 0
                assert server.metric("punica_x_batch_size") == 1
                break
    server.wait_idle(timeout=10)
    assert server.metric("punica_x_engine_aborts_total") == aborted + 1
    # counted as aborted: a 3000-token reply that ran to its end would count as "length"
    assert (
        server.metric("punica_x_requests_total", tenant="sse-quitter", status="abort") == before + 1
    )


def test_plain_request_disconnect_aborts(server):
    key = server.create_tenant("plain-quitter")
    server.wait_idle()
    aborted = server.metric("punica_x_engine_aborts_total")
    body = json.dumps(
        {"model": server.model_id, "prompt": "hello", "max_tokens": 3000, "ignore_eos": True}
    ).encode()
    port = int(server.url.rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer "
        + key.encode()
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    deadline = time.monotonic() + 10
    while server.metric("punica_x_kv_blocks_used") == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.metric("punica_x_kv_blocks_used") > 0
    s.close()
    server.wait_idle(timeout=10)
    assert server.metric("punica_x_engine_aborts_total") == aborted + 1
    assert server.metric("punica_x_requests_total", tenant="plain-quitter", status="abort") == 1
