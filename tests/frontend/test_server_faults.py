"""Faults as a client and an orchestrator see them (a server whose model cannot be built exits
1 with the cause on stderr: test_lamina_server.py); a request whose generation fails is an
error a client can see and retry (503 + Retry-After, or an error event in a stream), never
200 with partial text; /health says when nothing is left to serve."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from live_server import start_server, tenant_client
from websockets.sync.client import connect

KW = dict(max_tokens=2000, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def fragile_server(srv_model_dir, tmp_path_factory):
    """One engine process and no restart: once it is killed, nothing is left to serve."""
    srv = start_server(
        srv_model_dir,
        tmp_path_factory.mktemp("fragile-srv") / "data",
        "--runner-backend",
        "process",
        "--no-runner-restart",
    )
    yield srv
    srv.stop()


def test_requests_whose_runner_dies_fail_visibly(fragile_server, adapter_dirs):
    """A streamed and a non-streamed completion and a websocket chat are running when the
    only engine process is SIGKILLed (no restart): the stream ends with an error event (the
    SDK raises it), the completion answers 503 with Retry-After and an OpenAI error body, not
    200 with partial text, the chat gets an error frame; /health and /ready then answer 503."""
    srv = fragile_server
    client = tenant_client(srv, "fragile", "style", adapter_dirs["a"])
    key = client.api_key
    with srv.http(srv.admin_token) as c:
        (row,) = c.get("/admin/runners").json()["runners"]
    parts, raised, answers, started = [], [], [], threading.Event()

    def stream():
        try:
            for part in client.completions.create(
                model="style", prompt="stream me", stream=True, **KW
            ):
                parts.append(part.choices[0].finish_reason)
                if len(parts) >= 20:
                    started.set()
        except openai.APIError as exc:
            raised.append(exc)

    def whole():
        body = {"model": "style", "prompt": "answer me whole", **KW, "ignore_eos": True}
        body.pop("extra_body")
        with srv.http(key, timeout=120) as c:
            answers.append(c.post("/v1/completions", json=body))

    def chat():
        url = srv.url.replace("http://", "ws://") + "/v1/chat/ws"
        with connect(url, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
            frame = {"type": "chat", "model": "style", "max_tokens": 2000, "temperature": 0}
            frame |= {"ignore_eos": True, "messages": [{"role": "user", "content": "hi"}]}
            ws.send(json.dumps(frame))
            while (reply := json.loads(ws.recv(timeout=120)))["type"] == "token":
                pass
            frames.append(reply)

    frames: list[dict] = []
    threads = [threading.Thread(target=f) for f in (stream, whole, chat)]
    for t in threads:
        t.start()
    assert started.wait(60)
    time.sleep(0.2)  # the non-streamed one has begun too (one step holds both)
    os.kill(row["pid"], signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)

    assert len(raised) == 1 and "no runner is left" in str(raised[0]), (raised, parts[-3:])
    assert all(reason is None for reason in parts)  # no chunk pretended to finish
    (answer,) = answers
    assert answer.status_code == 503, answer.text
    assert int(answer.headers["Retry-After"]) >= 1
    error = answer.json()["error"]
    assert error["code"] == "generation_unavailable" and error["type"] == "server_error"
    assert "no runner is left" in error["message"]
    (frame,) = frames  # the chat page shows it as an error, not as a finished reply
    assert frame["type"] == "error" and frame["code"] == "generation_unavailable", frame
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 503
    assert httpx.get(srv.url + "/ready", timeout=10).status_code == 503
