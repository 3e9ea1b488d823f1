"""`punica-x serve --runner-backend process`: the runner's engine steps in a process of its
own (the server keeps HTTP and streaming). Answers equal the thread backend's; SIGKILL of
the engine process while a client streams: the stream resumes on the process started in its
place and ends with the same text, and the server serves a new request within 30 s."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from live_server import start_server, tenant_client

KW = dict(max_tokens=600, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def process_server(srv_model_dir, tmp_path_factory):
    srv = start_server(
        srv_model_dir,
        tmp_path_factory.mktemp("process-srv") / "data",
        "--runner-backend",
        "process",
    )
    yield srv
    srv.stop()


def runners(srv) -> list[dict]:
    with srv.http(srv.admin_token) as c:
        return c.get("/admin/runners").json()["runners"]


def test_a_killed_engine_process_costs_the_client_nothing(process_server, server, adapter_dirs):
    client = tenant_client(process_server, "on-process", "style", adapter_dirs["a"])
    thread_client = tenant_client(server, "on-threads-too", "style", adapter_dirs["a"])
    expected = thread_client.completions.create(model="style", prompt="kill me", **KW)
    expected = expected.choices[0].text
    (row,) = runners(process_server)
    assert row["backend"] == "process" and row["pid"] != process_server.proc.pid

    parts, started = [], threading.Event()

    def read():
        stream = client.completions.create(model="style", prompt="kill me", stream=True, **KW)
        for part in stream:
            parts.append(part.choices[0].text)
            if len(parts) >= 20:
                started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60)
    os.kill(row["pid"], signal.SIGKILL)
    killed = time.monotonic()
    fresh = client.completions.create(model="style", prompt="after the kill", max_tokens=8)
    assert time.monotonic() - killed < 30
    assert fresh.choices[0].finish_reason in ("length", "stop")
    reader.join(120)
    assert not reader.is_alive()
    assert "".join(parts) == expected
    assert process_server.metric("punica_x_migrations_total", reason="failure") == 1
    states = {r["id"]: (r["state"], r["pid"]) for r in runners(process_server)}
    assert states[row["id"]][0] == "dead"
    alive = [pid for state, pid in states.values() if state == "active"]
    assert len(alive) == 1 and alive[0] != row["pid"]
