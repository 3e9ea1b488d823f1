"""`punica-x serve --runner-backend ray --runners 2`: the server starts a local Ray and two
runner actors; answers equal the thread backend's, and a runner process killed while it
streams costs the client nothing."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from live_server import start_server, tenant_client

pytest.importorskip("ray")

KW = dict(max_tokens=1500, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def ray_server(srv_model_dir, tmp_path_factory):
    srv = start_server(
        srv_model_dir,
        tmp_path_factory.mktemp("ray-srv") / "data",
        "--runners",
        "2",
        "--runner-backend",
        "ray",
    )
    yield srv
    srv.stop()


def test_ray_runners_answer_as_thread_runners_and_survive_a_sigkill(
    ray_server, server, adapter_dirs
):
    ray_client = tenant_client(ray_server, "on-ray", "style", adapter_dirs["a"])
    thread_client = tenant_client(server, "on-threads", "style", adapter_dirs["a"])
    expected = thread_client.completions.create(model="style", prompt="kill me", **KW)
    expected = expected.choices[0].text
    with ray_server.http(ray_server.admin_token) as c:
        rows = c.get("/admin/runners").json()["runners"]
    assert [r["backend"] for r in rows] == ["ray", "ray"]
    pids = {r["pid"] for r in rows}
    assert len(pids) == 2 and ray_server.proc.pid not in pids

    parts, started = [], threading.Event()

    def read():
        stream = ray_client.completions.create(model="style", prompt="kill me", stream=True, **KW)
        for part in stream:
            parts.append(part.choices[0].text)
            if len(parts) == 20:
                started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60)
    with ray_server.http(ray_server.admin_token) as c:
        rows = c.get("/admin/runners").json()["runners"]
    busy = [r for r in rows if r["running"] + r["waiting"] > 0]
    assert len(busy) == 1
    os.kill(busy[0]["pid"], signal.SIGKILL)
    reader.join(120)
    assert "".join(parts) == expected
    assert ray_server.metric("punica_x_migrations_total", reason="failure") == 1
    with ray_server.http(ray_server.admin_token) as c:
        states = {r["id"]: r["state"] for r in c.get("/admin/runners").json()["runners"]}
    assert states[busy[0]["id"]] == "dead" and "active" in states.values()
