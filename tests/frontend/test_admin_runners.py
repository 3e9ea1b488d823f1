"""A server with 2 thread runners driven through the admin CLI: status, drain under live
streams (the clients notice nothing), scale up (the new runner serves every adapter),
the last runner refused, per-runner metrics."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import openai
import pytest
from live_server import start_server

KW = dict(max_tokens=2000, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def cluster(srv_model_dir, tmp_path_factory):
    srv = start_server(srv_model_dir, tmp_path_factory.mktemp("cluster") / "data", "--runners", "2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(cluster, adapter_dirs):
    key = cluster.create_tenant("ops")
    assert cluster.upload(key, "style", adapter_dirs["a"]).status_code == 201
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key=key, max_retries=0)


def admin(cluster, *args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "frontend.cli", "admin", *args]
    cmd += ["--url", cluster.url, "--data-dir", str(cluster.data_dir)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def runners(cluster) -> dict:
    with cluster.http(cluster.admin_token) as c:
        r = c.get("/admin/runners")
    assert r.status_code == 200, r.text
    return r.json()


def test_status_lists_both_runners_and_needs_the_admin_token(cluster, client):
    body = runners(cluster)
    assert [(r["id"], r["state"], r["backend"]) for r in body["runners"]] == [
        ("runner-0", "active", "thread"),
        ("runner-1", "active", "thread"),
    ]
    assert body["advice"] in ("none", "scale_down") and body["queued"] == 0
    model = dict(body["model"])
    assert model.pop("weight_format") == "float32" and model.pop("weight_bytes") > 1e5
    assert model == {"name": cluster.model_id, "family": "llama", "dtype": "float32"}
    fields = {"node", "pid", "device", "running", "waiting", "kv_blocks_used", "kv_blocks_free"}
    assert fields <= set(body["runners"][0])
    assert httpx.get(cluster.url + "/admin/runners").status_code == 401
    shown = admin(cluster, "status")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith(f"model: {cluster.model_id} (family llama, float32)")
    lines = lines[1:]
    assert lines[0].split()[:4] == ["ID", "BACKEND", "NODE", "STATE"]
    assert [line.split()[0] for line in lines[1:3]] == ["runner-0", "runner-1"]
    assert lines[-2].startswith("queued at the scheduler: 0; advice:")
    assert lines[-1].startswith("prefix cache: ")
    # both runners decided batch invariance alike (auto measures each at its start)
    reason = body["runners"][0]["batch_invariant_reason"]
    assert reason.startswith("auto: ") and body["runners"][1]["batch_invariant_reason"] == reason
    assert lines[-3] == f"batch invariance of runner-0, runner-1: {reason}"
    on = "on" if body["runners"][0]["batch_invariant"] else "off"
    assert lines[0].split()[-4:] == ["PREFIX", "HITS", "ADAPTERS", "INVARIANT"]
    assert [line.split()[-1] for line in lines[1:3]] == [on, on]


def test_drain_under_live_streams_then_scale_up_then_the_last_is_refused(cluster, client):
    models = ("style", cluster.model_id)
    prompts = ("the first client", "a second client")
    expected = [
        client.completions.create(model=m, prompt=p, **KW).choices[0].text
        for m, p in zip(models, prompts)
    ]
    texts, started = [[], []], [threading.Event(), threading.Event()]

    def read(i):
        stream = client.completions.create(model=models[i], prompt=prompts[i], stream=True, **KW)
        for part in stream:
            texts[i].append(part.choices[0].text)
            if len(texts[i]) == 5:
                started[i].set()

    readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in readers:
        t.start()
    assert all(e.wait(60) for e in started)
    busy = [r for r in runners(cluster)["runners"] if r["running"] + r["waiting"] > 0]
    assert [r["id"] for r in busy] == ["runner-0"]  # consolidated onto one runner
    drained = admin(cluster, "scale", "down", "--runner", "runner-0")
    assert drained.returncode == 0, drained.stderr
    assert drained.stdout.startswith("drained: runner-0")
    for t in readers:
        t.join(120)
    assert ["".join(t) for t in texts] == expected
    assert cluster.metric("punica_x_migrations_total", reason="drain") == 2  # either mode
    assert [r["id"] for r in runners(cluster)["runners"]] == ["runner-1"]

    up = admin(cluster, "scale", "up")
    assert up.returncode == 0, up.stderr
    assert up.stdout.startswith("added: runner-2")
    down = admin(cluster, "scale", "down")  # the least loaded: both idle, the newest goes
    assert down.returncode == 0 and down.stdout.startswith("drained: runner-2"), down.stderr
    up = admin(cluster, "scale", "up")
    assert up.returncode == 0 and up.stdout.startswith("added: runner-3"), up.stderr
    assert admin(cluster, "scale", "down", "--runner", "runner-1").returncode == 0
    # runner-3 is all that is left: it was given the adapter uploaded before it existed
    again = client.completions.create(model="style", prompt=prompts[0], **KW)
    assert again.choices[0].text == expected[0]
    last = admin(cluster, "scale", "down")
    assert last.returncode == 1 and "last active runner" in last.stderr
    refused = admin(cluster, "scale", "down", "--runner", "runner-3")
    assert refused.returncode == 1 and "(409)" in refused.stderr
    assert cluster.metric("punica_x_runner_active", runner="runner-3", state="active") == 1
    assert cluster.metric("punica_x_runner_running", runner="runner-3") == 0
