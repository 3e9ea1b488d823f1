"""vLLM's dynamic LoRA API (frontend/routes/lora_api.py): the calls vLLM documents (load by
path, generate with the name, list, unload) run unchanged and answer as vLLM does; a tenant
loads only from its own source folder; every hostile name, path, file or body is a clear 4xx
that changes nothing; a server without --lora-source-root answers 404."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from live_server import start_server

FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def source_root(tmp_path_factory, adapter_dirs):
    """acme's folder holds adapters a and b; `outside` is a folder no tenant may read."""
    root = tmp_path_factory.mktemp("lora-sources")
    for name in ("a", "b"):
        shutil.copytree(adapter_dirs[name], root / "acme" / f"lora-{name}")
    outside = tmp_path_factory.mktemp("outside")
    (outside / "other").mkdir()  # the operator may link a tenant's folder elsewhere
    (root / "other").symlink_to(outside / "other")
    shutil.copytree(adapter_dirs["a"], outside / "stolen")
    return root, outside


@pytest.fixture(scope="module")
def lora_server(srv_model_dir, tmp_path_factory, source_root):
    srv = start_server(
        srv_model_dir,
        tmp_path_factory.mktemp("lora-api") / "data",
        *("--lora-source-root", str(source_root[0])),
        *("--limit", "max_upload_bytes=200000", "--limit", "max_adapters_per_tenant=3"),
    )
    tenants = ("acme", "acme2", "other", "hostile", "bytes", "quota")
    srv.keys = {t: srv.create_tenant(t) for t in tenants}
    yield srv
    srv.stop()


def _complete(srv, key, model):
    body = {"model": model, "prompt": "hello world", "max_tokens": 8, "temperature": 0}
    with srv.http(key) as c:
        return c.post("/v1/completions", json={**body, "ignore_eos": True})


def _adapters(srv, key) -> list[tuple[str, int]]:
    with srv.http(key) as c:
        return [(a["name"], a["version"]) for a in c.get("/v1/adapters").json()["data"]]


def test_vllm_documented_calls_run_unchanged(lora_server, source_root, adapter_dirs):
    srv, (root, _) = lora_server, source_root
    key = srv.keys["acme"]
    uploaded = srv.create_tenant("uploader")
    assert srv.upload(uploaded, "same", adapter_dirs["a"]).status_code == 201
    with srv.http(key) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "lora-a"})
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
        models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert models["sql"]["root"] == "lora-a" and models["sql"]["parent"] == srv.model_id
        assert models[srv.model_id]["parent"] is None
        assert c.get("/v1/adapters/sql").json()["source"] == "lora-a"
        # the same files uploaded by another tenant give the same tokens
        assert _complete(srv, key, "sql").json() != _complete(srv, key, srv.model_id).json()
        text = _complete(srv, key, "sql").json()["choices"][0]["text"]
        assert text == _complete(srv, uploaded, "same").json()["choices"][0]["text"]
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "lora-b"})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "The lora adapter 'sql' has already been loaded."
        absolute = str(root / "acme" / "lora-b")
        for path in (absolute, "file://" + absolute):  # an absolute path and a file:// URI
            body = {"lora_name": "sql", "lora_path": path, "load_inplace": True}
            assert c.post("/v1/load_lora_adapter", json=body).status_code == 200
        record = c.get("/v1/adapters/sql").json()
        assert (record["version"], record["rank"], record["source"]) == (3, 8, "file://" + absolute)
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
        assert _complete(srv, key, "sql").status_code == 404
        assert "sql" not in {m["id"] for m in c.get("/v1/models").json()["data"]}
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "sql", "lora_int_id": 1})
        assert r.status_code == 404
        assert r.json()["error"]["message"] == "The lora adapter 'sql' cannot be found."


def test_a_tenant_loads_only_from_its_own_folder(lora_server, source_root):
    srv, (root, outside) = lora_server, source_root
    acme, key = srv.keys["acme2"], srv.keys["other"]
    shutil.copytree(root / "acme" / "lora-a", root / "acme2" / "mine")
    (root / "other" / "escape").symlink_to(outside / "stolen")
    steal = root / "other" / "half-stolen"
    steal.mkdir()
    (steal / FILES[0]).write_bytes((outside / "stolen" / FILES[0]).read_bytes())
    (steal / FILES[1]).symlink_to(outside / "stolen" / FILES[1])
    refused = [
        "../acme/lora-a",
        str(root / "acme" / "lora-a"),
        "file://" + str(root / "acme" / "lora-a"),
        str(outside / "stolen"),
        "escape",  # a link out of the folder
        "half-stolen",  # a folder whose weights link out of it
        "/etc",
        "/no/such/folder",  # 403, not 404: nothing outside the folder is probed
        "../no-such-tenant/x",
    ]
    with srv.http(key) as c:
        for path in refused:
            r = c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
            assert r.status_code == 403, (path, r.text)
            assert r.json()["error"]["code"] == "lora_path_forbidden"
        # acme2's adapter is not other's to see or unload
        with srv.http(acme) as mine:
            body = {"lora_name": "mine", "lora_path": "mine"}
            assert mine.post("/v1/load_lora_adapter", json=body).status_code == 200
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "mine"}).status_code == 404
        assert "mine" not in {m["id"] for m in c.get("/v1/models").json()["data"]}
        # other's own folder is a link the operator made: what is in it loads
        shutil.copytree(root / "acme" / "lora-a", outside / "other" / "ok")
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "ok", "lora_path": "ok"})
        assert r.status_code == 200, r.text
    assert _adapters(srv, key) == [("ok", 1)] and _adapters(srv, acme) == [("mine", 1)]


def _hostile_folder(folder, adapter_dirs, kind: str) -> str:
    """`folder` made with one thing wrong (`kind`); returns its name."""
    folder.mkdir(parents=True)
    config, weights = (adapter_dirs["a"] / f for f in FILES)
    (folder / FILES[0]).write_bytes(config.read_bytes())
    if kind == "no-weights":
        return folder.name
    if kind == "fifo":  # reading it would block forever
        os.mkfifo(folder / FILES[1])
    elif kind == "garbage":
        (folder / FILES[1]).write_bytes(b"\x00" * 64)
    elif kind == "too-large":
        (folder / FILES[1]).write_bytes(b"\x00" * 200_001)
    elif kind == "nan":
        import torch
        from safetensors.torch import load_file, save_file

        tensors = load_file(weights)
        first = sorted(tensors)[0]
        tensors[first] = torch.full_like(tensors[first], float("nan"))
        save_file(tensors, folder / FILES[1])
    elif kind == "config-dir":
        (folder / FILES[0]).unlink()
        (folder / FILES[0]).mkdir()
        shutil.copy(weights, folder / FILES[1])
    return folder.name


@pytest.mark.parametrize(
    "kind, status, code",
    [
        ("no-weights", 400, "missing_file"),
        ("fifo", 400, "not_a_file"),
        ("config-dir", 400, "not_a_file"),
        ("garbage", 400, None),
        ("too-large", 413, "payload_too_large"),
        ("nan", 400, "non_finite"),
    ],
)
def test_hostile_files_are_refused(lora_server, source_root, adapter_dirs, kind, status, code):
    srv, (root, _) = lora_server, source_root
    key = srv.keys["hostile"]
    path = _hostile_folder(root / "hostile" / kind, adapter_dirs, kind)
    with srv.http(key, timeout=30) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "h", "lora_path": path})
    assert r.status_code == status, r.text
    assert code is None or r.json()["error"]["code"] == code, r.text
    assert _adapters(srv, key) == []


BAD_BODIES = [
    ({"lora_path": "lora-a"}, 400),  # no name
    ({"lora_name": "x"}, 400),  # no path
    ({"lora_name": 5, "lora_path": "lora-a"}, 400),
    ({"lora_name": None, "lora_path": "lora-a"}, 400),
    ({"lora_name": "", "lora_path": "lora-a"}, 400),
    ({"lora_name": "../x", "lora_path": "lora-a"}, 400),
    ({"lora_name": "a" * 65, "lora_path": "lora-a"}, 400),
    ({"lora_name": "x", "lora_path": 5}, 400),
    ({"lora_name": "x", "lora_path": ["lora-a"]}, 400),
    ({"lora_name": "x", "lora_path": ""}, 400),
    ({"lora_name": "x", "lora_path": "x" * 5000}, 400),
    ({"lora_name": "x", "lora_path": "a" * 300 + "/b"}, 400),  # a name too long to stat
    ({"lora_name": "x", "lora_path": "lora-a\x00"}, 400),
    ({"lora_name": "x", "lora_path": "\ud800"}, 400),
    ({"lora_name": "x", "lora_path": "s3://bucket/lora"}, 400),
    ({"lora_name": "x", "lora_path": "https://example.com/lora"}, 400),
    ({"lora_name": "x", "lora_path": "file://evil.example/lora-a"}, 400),
    ({"lora_name": "x", "lora_path": "file:///lora-a%00"}, 400),
    ({"lora_name": "x", "lora_path": "http://[bad/x"}, 400),
    ({"lora_name": "x", "lora_path": "not-there"}, 404),
    ({"lora_name": "x", "lora_path": "lora-a", "load_inplace": "yes"}, 400),
    ({"lora_name": "x", "lora_path": "lora-a", "extra": 1}, 400),
    ([{"lora_name": "x", "lora_path": "lora-a"}], 400),
]


@pytest.mark.parametrize("body, status", BAD_BODIES)
def test_bad_load_bodies_are_refused(lora_server, body, status):
    srv = lora_server
    key = srv.keys["acme"]
    before = _adapters(srv, key)
    with srv.http(key) as c:  # ASCII JSON: a lone surrogate travels as its escape
        r = c.post("/v1/load_lora_adapter", content=json.dumps(body))
    assert r.status_code == status, r.text
    assert "error" in r.json()
    assert _adapters(srv, key) == before


@pytest.mark.parametrize(
    "body",
    [{}, {"lora_name": 5}, {"lora_name": "x", "lora_int_id": -1}, {"lora_name": "x", "y": 1}],
)
def test_bad_unload_bodies_are_refused(lora_server, body):
    with lora_server.http(lora_server.keys["acme"]) as c:
        assert c.post("/v1/unload_lora_adapter", json=body).status_code == 400


def test_bodies_that_are_not_json_or_too_large(lora_server):
    with lora_server.http(lora_server.keys["acme"]) as c:
        assert c.post("/v1/load_lora_adapter", content=b"{nope").status_code == 400
        big = b'{"lora_name": "x", "lora_path": "' + b"a" * 70_000 + b'"}'
        assert c.post("/v1/load_lora_adapter", content=big).status_code == 413
        anonymous = {"Authorization": ""}
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "x"}, headers=anonymous)
        assert r.status_code == 401


def test_off_without_a_source_root(server):
    key = server.create_tenant("no-sources")
    with server.http(key) as c:
        for route, body in [
            ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "x"}),
            ("/v1/unload_lora_adapter", {"lora_name": "x"}),
        ]:
            r = c.post(route, json=body)
            assert r.status_code == 404 and r.json()["error"]["code"] == "lora_loading_off"


def test_an_adapter_loads_on_its_first_request(lora_server, source_root, adapter_dirs):
    """A request naming a folder of the caller's source loads it (once, however many
    requests race for it) and runs on it; another tenant naming it gets 404; a refused folder
    fails the request with the refusal and serves nothing."""
    import concurrent.futures

    srv, (root, _) = lora_server, source_root
    key, other = srv.keys["acme"], srv.keys["other"]
    shutil.copytree(adapter_dirs["b"], root / "acme" / "on-request")
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: _complete(srv, key, "on-request"), range(6)))
    assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
    assert len({r.json()["choices"][0]["text"] for r in answers}) == 1
    assert ("on-request", 1) in _adapters(srv, key)  # one version, not six
    with srv.http(key) as c:
        assert c.get("/v1/adapters/on-request").json()["source"] == "on-request"
    assert _complete(srv, other, "on-request").status_code == 404
    for name in ("no-such-folder", "../acme/lora-a", "lora-a/"):
        r = _complete(srv, key, name)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", name
    hostile = srv.keys["hostile"]
    _hostile_folder(root / "hostile" / "nan-on-request", adapter_dirs, "nan")
    r = _complete(srv, hostile, "nan-on-request")
    assert r.status_code == 400 and r.json()["error"]["code"] == "non_finite", r.text
    assert ("nan-on-request", 1) not in _adapters(srv, hostile)


def test_unload_gives_back_the_device_and_disk_bytes(lora_server, source_root, adapter_dirs):
    """Once unloaded and no request holds it, the adapter's device bytes (the pool's gauge)
    and its stored files are gone."""
    import time

    srv, (root, _) = lora_server, source_root
    key = srv.keys["bytes"]
    shutil.copytree(adapter_dirs["b"], root / "bytes" / "big")
    srv.wait_idle()
    before = srv.metric("punica_x_adapter_device_bytes")
    with srv.http(key) as c:
        body = {"lora_name": "big", "lora_path": "big"}
        assert c.post("/v1/load_lora_adapter", json=body).status_code == 200
        assert _complete(srv, key, "big").status_code == 200
        held = srv.metric("punica_x_adapter_device_bytes")
        stored = [p for p in (srv.data_dir / "adapters").glob("*/big/v*") if p.is_dir()]
        assert held > before and len(stored) == 1
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "big"}).status_code == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        gone = not stored[0].exists()
        if gone and srv.metric("punica_x_adapter_device_bytes") == before:
            break
        time.sleep(0.2)
    assert srv.metric("punica_x_adapter_device_bytes") == before
    assert not stored[0].exists()


def test_a_tenant_holds_at_most_its_quota_of_adapters(lora_server, source_root, adapter_dirs):
    """--limit max_adapters_per_tenant=3: a fourth name is 403 however it comes (load,
    upload, first request) and changes nothing; a new version of a held name is not counted;
    unloading one makes room."""
    srv, (root, _) = lora_server, source_root
    key = srv.keys["quota"]
    for name in ("q1", "q2", "q3", "q4"):
        shutil.copytree(adapter_dirs["a"], root / "quota" / name)
    with srv.http(key) as c:

        def load(name, **extra):
            return c.post(
                "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": name, **extra}
            )

        assert [load(n).status_code for n in ("q1", "q2", "q3")] == [200] * 3
        r = load("q4")
        assert r.status_code == 403 and r.json()["error"]["code"] == "adapter_quota_exceeded"
        assert srv.upload(key, "q4", adapter_dirs["a"]).status_code == 403
        assert _complete(srv, key, "q4").status_code == 403  # its first request
        assert load("q1", load_inplace=True).status_code == 200  # a new version: not counted
        assert sorted(_adapters(srv, key)) == [("q1", 2), ("q2", 1), ("q3", 1)]
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "q2"}).status_code == 200
        assert load("q4").status_code == 200


def test_vllm_metric_names_for_gateways(lora_server, source_root, adapter_dirs):
    """vLLM's names on /metrics (frontend/http/vllm_metrics.py): while a request on adapter
    `busy` streams, lora_requests_info lists it as running, and the request gauges count it."""
    import re
    import threading

    srv, (root, _) = lora_server, source_root
    key = srv.keys["acme2"]
    shutil.copytree(adapter_dirs["b"], root / "acme2" / "busy")
    with srv.http(key) as c:
        body = {"lora_name": "busy", "lora_path": "busy"}
        assert c.post("/v1/load_lora_adapter", json=body).status_code == 200
    started = threading.Event()

    def stream():
        body = {"model": "busy", "prompt": "count", "max_tokens": 400, "stream": True}
        body["ignore_eos"] = True
        with srv.http(key, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
            for _ in r.iter_lines():
                started.set()

    worker = threading.Thread(target=stream)
    worker.start()
    try:
        assert started.wait(60)
        with srv.http(srv.admin_token) as c:
            text = c.get("/metrics").text
    finally:
        worker.join(120)
    info = re.search(r"^vllm:lora_requests_info\{(.*)\} (\S+)$", text, re.M)
    assert info is not None, text[-2000:]
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1)))
    assert "busy" in labels["running_lora_adapters"].split(",")
    assert int(labels["max_lora"]) >= 1 and float(info.group(2)) > 1e9
    running = re.search(r'^vllm:num_requests_running\{model_name="(.*)"\} (\S+)$', text, re.M)
    assert running.group(1) == srv.model_id and float(running.group(2)) >= 1
    use = re.search(r"^vllm:kv_cache_usage_perc\{.*\} (\S+)$", text, re.M)
    assert 0 < float(use.group(1)) <= 1
    assert re.search(r"^vllm:num_requests_waiting\{.*\} \S+$", text, re.M)
