"""A server whose adapters live in an object store (serve --lora-source-root s3://...), against
an S3-compatible server the test starts (moto's) behind a proxy that can hang: vLLM's calls
load by key, list the object's URI and ETags, generate and unload; a request naming a folder
of the store loads it; a NaN adapter is refused; while one tenant's store hangs, another
tenant's stream goes on and the hanging load ends 504."""

from __future__ import annotations

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
        _put_nan(client, adapter_dirs["a"], tmp_path_factory.mktemp("nan"))
        host, port = url.removeprefix("http://").split(":")
        proxy = FaultyProxy((host, int(port)))
        with aws_environment(proxy.url):  # the server process inherits it
            srv = start_server(
                srv_model_dir,
                tmp_path_factory.mktemp("lora-s3") / "data",
                *("--lora-source-root", f"s3://{BUCKET}/root", "--lora-source-timeout-s", "1"),
            )
        srv.keys = {t: srv.create_tenant(t) for t in ("acme", "uploader", "hostile")}
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
