"""Overload: the bounded queue is shared fairly between tenants (429 for a tenant holding its
share, 503 at twice its size); per-tenant limits give that tenant 429 + Retry-After while
other tenants are unaffected; per-key stream caps."""

from __future__ import annotations

import threading
import time

import pytest
from live_server import start_server

LONG = {"prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}


def hold_stream(server, key, started: threading.Event, stop: threading.Event):
    """Keep a streaming request open until `stop` is set."""

    def run():
        with (
            server.http(key) as c,
            c.stream("POST", "/v1/completions", json={"model": server.model_id, **LONG}) as r,
        ):
            for _ in r.iter_lines():
                started.set()
                if stop.is_set():
                    break

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def short(server, key):
    with server.http(key) as c:
        return c.post(
            "/v1/completions", json={"model": server.model_id, "prompt": "hi", "max_tokens": 4}
        )


@pytest.fixture(scope="module")
def small_server(srv_model_dir, tmp_path_factory):
    srv = start_server(
        srv_model_dir,
        tmp_path_factory.mktemp("small") / "data",
        "--max-batch-size",
        "1",
        "--limit",
        "max_queue=1",
    )
    yield srv
    srv.stop()


def test_bounded_queue_is_shared_fairly(small_server):
    """batch 1, max_queue 1: tenant q1 runs, q2 waits (the queue is full). q2's next request
    is 429 (it holds its share of the queue) while q3, holding none, may still queue; at twice
    max_queue the server answers everyone 503 overloaded. Every refusal has Retry-After, and
    every admitted request is served once the queue drains."""
    srv = small_server
    a, b, c, d = (srv.create_tenant(f"q{i}") for i in range(1, 5))
    stop = threading.Event()
    first, second = threading.Event(), threading.Event()
    threads = [hold_stream(srv, a, first, stop)]
    assert first.wait(30)
    threads.append(hold_stream(srv, b, second, stop))  # waits: the batch holds one request
    wait_for_queue(srv, 1)
    r = short(srv, b)
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_share_exceeded"
    assert int(r.headers["Retry-After"]) >= 1
    answers = []
    late = threading.Thread(target=lambda: answers.append(short(srv, c)), daemon=True)
    late.start()  # q3 holds nothing: it may queue beyond max_queue
    wait_for_queue(srv, 2)
    r = short(srv, d)
    assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
    assert int(r.headers["Retry-After"]) >= 1
    stop.set()
    for t in (*threads, late):
        t.join(60)
    assert answers and answers[0].status_code == 200, answers
    srv.wait_idle()
    assert short(srv, b).status_code == 200


def wait_for_queue(srv, n: int) -> None:
    deadline = time.monotonic() + 10
    while srv.metric("punica_x_queue_length") < n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.metric("punica_x_queue_length") >= n


def test_streams_per_key_are_capped(server):
    """The session server allows 2 concurrent streams per key."""
    key = server.create_tenant("streamer")
    stop = threading.Event()
    started = [threading.Event(), threading.Event()]
    threads = [hold_stream(server, key, e, stop) for e in started]
    assert all(e.wait(30) for e in started)
    with server.http(key) as c:
        r = c.post("/v1/completions", json={"model": server.model_id, **LONG})
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_streams"
        assert "Retry-After" in r.headers
        plain = c.post(
            "/v1/completions", json={"model": server.model_id, "prompt": "x", "max_tokens": 2}
        )
        assert plain.status_code == 200  # the cap is on streams, not requests
    stop.set()
    for t in threads:
        t.join(30)
    server.wait_idle()
    with server.http(key) as c:  # the slots are free again once the streams ended
        body = {"model": server.model_id, "prompt": "x", "max_tokens": 2, "stream": True}
        for _ in range(3):
            assert c.post("/v1/completions", json=body).status_code == 200


def test_tenant_concurrency_limit_is_per_tenant(server):
    limited = server.create_tenant("limited", max_concurrent=1)
    free = server.create_tenant("unlimited")
    stop, started = threading.Event(), threading.Event()
    t = hold_stream(server, limited, started, stop)
    assert started.wait(30)
    r = short(server, limited)
    assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_requests"
    assert int(r.headers["Retry-After"]) >= 1
    assert short(server, free).status_code == 200  # other tenants are unaffected
    stop.set()
    t.join(30)
    server.wait_idle()
    assert short(server, limited).status_code == 200  # its slot is free again


def test_tokens_per_minute(server):
    thrifty = server.create_tenant("thrifty", tokens_per_minute=40)
    other = server.create_tenant("spender")
    with server.http(thrifty) as c:
        r = c.post(
            "/v1/completions",
            json={
                "model": server.model_id,
                "prompt": "hello",
                "max_tokens": 40,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200
        r = c.post(
            "/v1/completions", json={"model": server.model_id, "prompt": "hi", "max_tokens": 4}
        )
    assert r.status_code == 429 and r.json()["error"]["code"] == "tokens_per_minute_exceeded"
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    assert short(server, other).status_code == 200
