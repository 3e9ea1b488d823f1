"""A server whose adapters live in an object store (serve --lora-source-root s3://...), against
an S3-compatible server the test starts (moto's) behind a proxy that can hang: vLLM's calls
load by key, list the object's URI and ETags, generate and unload; a request naming a folder
of the store loads it; a NaN adapter is refused; while one tenant's store hangs, another
tenant's stream goes on and the hanging load ends 504. A tenant given a source of its own
(PATCH /admin/tenants/{name} {"lora_source"}) loads from there only; a bad source is 400
and changes nothing."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from live_server import start_server
from s3_store import BUCKET, FaultyProxy, aws_environment, moto_store, put_folder

pytest.importorskip("s3fs")


@pytest.fixture(scope="module")
def store_server(srv_model_dir, tmp_path_factory, adapter_dirs):
    with moto_store() as (url, client):
        put_folder(client, "root/acme/lora-a", adapter_dirs["a"])
        put_folder(client, "root/acme/lora-b", adapter_dirs["b"])
        put_folder(client, "teams/own/lora-o", adapter_dirs["b"])  # tenant "own"'s own bucket
        put_folder(client, "root/own/lora-r", adapter_dirs["a"])  # under the server's root
        _put_nan(client, adapter_dirs["a"], tmp_path_factory.mktemp("nan"))
        host, port = url.removeprefix("http://").split(":")
        proxy = FaultyProxy((host, int(port)))
        with aws_environment(proxy.url):  # the server process inherits it
            srv = start_server(
                srv_model_dir,
                tmp_path_factory.mktemp("lora-s3") / "data",
                *("--lora-source-root", f"s3://{BUCKET}/root", "--lora-source-timeout-s", "1"),
            )
        srv.keys = {t: srv.create_tenant(t) for t in ("acme", "uploader", "hostile", "own")}
        srv.proxy = proxy
        try:
            yield srv
        finally:
            srv.stop()
            proxy.close()


def _put_nan(client, adapter, tmp) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(adapter / "adapter_model.safetensors")
    first = sorted(tensors)[0]
    tensors[first] = torch.full_like(tensors[first], float("nan"))
    save_file(tensors, tmp / "adapter_model.safetensors")
    (tmp / "adapter_config.json").write_bytes((adapter / "adapter_config.json").read_bytes())
    put_folder(client, "root/hostile/nan", tmp)


def _complete(srv, key, model, **kw):
    body = {"model": model, "prompt": "hello world", "max_tokens": 8, "temperature": 0}
    with srv.http(key, timeout=60) as c:
        return c.post("/v1/completions", json={**body, "ignore_eos": True, **kw})


def test_vllm_calls_load_from_the_store(store_server, adapter_dirs):
    srv = store_server
    key = srv.keys["acme"]
    assert srv.upload(srv.keys["uploader"], "same", adapter_dirs["a"]).status_code == 201
    with srv.http(key, timeout=60) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "lora-a"})
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
        root = {m["id"]: m for m in c.get("/v1/models").json()["data"]}["sql"]["root"]
        uri, etags = root.split("#etag=")
        assert uri == f"s3://{BUCKET}/root/acme/lora-a" and len(etags.split(",")) == 2
        assert c.get("/v1/adapters/sql").json()["source"] == root
        ours = _complete(srv, key, "sql").json()["choices"][0]["text"]
        same = _complete(srv, srv.keys["uploader"], "same").json()["choices"][0]["text"]
        assert ours == same
        body = {"lora_name": "x", "lora_path": f"s3://{BUCKET}/root/hostile/nan"}
        assert c.post("/v1/load_lora_adapter", json=body).status_code == 403
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 200
        assert "sql" not in {m["id"] for m in c.get("/v1/models").json()["data"]}


def test_a_request_naming_a_folder_of_the_store_loads_it(store_server):
    srv = store_server
    key = srv.keys["acme"]
    r = _complete(srv, key, "lora-b")
    assert r.status_code == 200, r.text
    with srv.http(key) as c:
        assert c.get("/v1/adapters/lora-b").json()["source"].startswith(f"s3://{BUCKET}/")
    assert _complete(srv, key, "not-in-the-store").status_code == 404


def test_a_nan_adapter_in_the_store_is_refused(store_server):
    srv = store_server
    key = srv.keys["hostile"]
    with srv.http(key, timeout=60) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "n", "lora_path": "nan"})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "non_finite"), r.text
        assert c.get("/v1/adapters").json()["data"] == []


def test_a_hanging_store_leaves_other_tenants_streams_alone(store_server):
    srv = store_server
    before = time.monotonic()
    assert _complete(srv, srv.keys["acme"], srv.model_id).status_code == 200
    baseline = time.monotonic() - before
    srv.proxy.mode = "hang"
    answers = []

    def load():
        with srv.http(srv.keys["hostile"], timeout=60) as c:
            body = {"lora_name": "h", "lora_path": "anything"}
            answers.append(c.post("/v1/load_lora_adapter", json=body))

    try:
        loading = threading.Thread(target=load)
        loading.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        streamed = _complete(srv, srv.keys["acme"], srv.model_id, stream=True)
        took = time.monotonic() - t0
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("[DONE]")
        assert loading.is_alive()  # the stream finished while the load still hung
        assert took < 5 * baseline + 1.0
        loading.join(30)
    finally:
        srv.proxy.mode = "pass"
    assert answers and answers[0].status_code == 504
    assert answers[0].json()["error"]["code"] == "source_timeout"


def _set_source(srv, tenant, value):
    with srv.http(srv.admin_token) as c:
        return c.patch(f"/admin/tenants/{tenant}", json={"lora_source": value})


def _tenant_source(srv, tenant):
    with srv.http(srv.admin_token) as c:
        return {t["name"]: t for t in c.get("/admin/tenants").json()["data"]}[tenant]["lora_source"]


def _load(srv, key, name, path):
    with srv.http(key, timeout=60) as c:
        return c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def test_a_tenant_with_a_source_of_its_own_loads_from_there_only(store_server):
    srv, key = store_server, store_server.keys["own"]
    r = _set_source(srv, "own", f"s3://{BUCKET}/teams/own/")
    assert (r.status_code, r.json()["lora_source"]) == (200, f"s3://{BUCKET}/teams/own")
    assert _load(srv, key, "o", "lora-o").status_code == 200
    with srv.http(key) as c:
        root = c.get("/v1/adapters/o").json()["source"]
    assert root.startswith(f"s3://{BUCKET}/teams/own/lora-o#etag=")
    assert _complete(srv, key, "lora-o").status_code == 200  # first use, from its own source
    for path, status in [
        ("lora-r", 404),  # the server's root/own/ is not its source any more
        (f"s3://{BUCKET}/root/own/lora-r", 403),
        ("../../root/own/lora-r", 400),
        (f"s3://{BUCKET}/teams/other", 403),
        ("s3://elsewhere/teams/own/lora-o", 403),
    ]:
        assert _load(srv, key, "x", path).status_code == status, path
    assert _load(srv, srv.keys["acme"], "not-mine", "lora-o").status_code == 404  # acme: root
    shown = _cli(srv, "list")
    assert shown.returncode == 0 and f"s3://{BUCKET}/teams/own" in shown.stdout, shown.stderr
    cleared = _cli(srv, "source", "own")  # no URI: the server's root again
    assert cleared.returncode == 0 and "the server root" in cleared.stdout, cleared.stderr
    assert _tenant_source(srv, "own") is None
    refused = _cli(srv, "source", "own", "gs://adapters/x")
    assert refused.returncode == 1 and "invalid_lora_source" in refused.stderr
    assert _load(srv, key, "r", "lora-r").status_code == 200
    assert _load(srv, key, "o2", "lora-o").status_code == 404
    with srv.http(key) as c:
        assert c.get("/v1/adapters/o").json()["source"] == root  # loaded ones stay as they were


@pytest.mark.parametrize(
    "value",
    [123, True, ["s3://adapters/x"], {"uri": "s3://adapters/x"}, "gs://adapters/x",
     "file:///etc", "/etc", "s3://UPPER/x", "s3://adapters/../x", "s3://adapters/a//b",
     "s3://adapters/x?versionId=1", "s3://adapters/x#f", "s3://adapters/\x00x",
     "s3://adapters/" + "x" * 1100, "s3://"],
)  # fmt: skip
def test_a_bad_tenant_source_is_400_and_changes_nothing(store_server, value):
    srv = store_server
    before = _tenant_source(srv, "hostile")
    r = _set_source(srv, "hostile", value)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] in ("invalid_lora_source", "invalid_value"), r.text
    assert _tenant_source(srv, "hostile") == before
    with srv.http(srv.admin_token) as c:
        assert c.patch("/admin/tenants/nobody", json={"lora_source": ""}).status_code == 404


def _cli(srv, *args):
    cmd = [sys.executable, "-m", "frontend.cli", "admin", "tenant", *args]
    cmd += ["--url", srv.url, "--data-dir", str(srv.data_dir)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)
