"""Out of disk space during an upload (a write hook in the server's process): a clear 507,
nothing half-written left, the version the runners serve unchanged, and the server serving."""

from __future__ import annotations

import errno
import time

import pytest
from starlette.testclient import TestClient

from frontend.config import ServerConfig
from frontend.http.app import create_app
from frontend.tenancy import durable, store
from frontend.tenancy.durable import StorageFull
from punica_x.config import EngineConfig, ModelConfig

FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def app_client(srv_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("full") / "data"
    config = ServerConfig(data_dir=data, engine=EngineConfig(model=ModelConfig(str(srv_model_dir))))
    with TestClient(create_app(config)) as client:
        deadline = time.monotonic() + 300
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, client.get("/ready").text
            time.sleep(0.1)
        admin = {"Authorization": "Bearer " + (data / "admin_token").read_text().strip()}
        r = client.post("/admin/tenants", json={"name": "full"}, headers=admin)
        client.headers["Authorization"] = "Bearer " + r.json()["api_key"]
        yield client, data


def upload(client, name, folder):
    files = {f: (f, (folder / f).read_bytes()) for f in FILES}
    return client.post("/v1/adapters", data={"name": name}, files=files)


def complete(client, model) -> str:
    r = client.post(
        "/v1/completions",
        json={"model": model, "prompt": [5, 17, 42], "max_tokens": 6, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def assert_clean(data) -> None:
    assert list((data / "staging").iterdir()) == []
    assert list((data / "quarantine").iterdir()) == []


def test_disk_full_while_writing_the_upload(app_client, adapter_dirs, monkeypatch):
    client, data = app_client
    real = durable.write_file

    def full_after_half(path, payload):
        if path.name == FILES[1]:
            path.write_bytes(payload[: len(payload) // 2])
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, payload)

    monkeypatch.setattr(durable, "write_file", full_after_half)
    r = upload(client, "first", adapter_dirs["a"])
    assert r.status_code == 507, r.text
    assert r.json()["error"]["code"] == "insufficient_storage"
    assert_clean(data)
    assert client.get("/v1/adapters/first").status_code == 404
    monkeypatch.setattr(durable, "write_file", real)
    assert client.get("/v1/models").status_code == 200
    r = upload(client, "first", adapter_dirs["a"])
    assert r.status_code == 201 and r.json()["version"] == 1, r.text


def test_disk_full_at_the_commit_keeps_the_old_version(app_client, adapter_dirs, monkeypatch):
    client, data = app_client
    assert upload(client, "second", adapter_dirs["a"]).status_code == 201
    before = complete(client, "second")

    def full(self, record):
        raise StorageFull("database or disk is full")

    monkeypatch.setattr(store.Store, "commit_adapter", full)
    r = upload(client, "second", adapter_dirs["b"])
    assert r.status_code == 507, r.text
    assert r.json()["error"]["code"] == "insufficient_storage"
    assert_clean(data)
    # the runners were put back on the committed version; the reserved one is undone
    assert complete(client, "second") == before
    got = client.get("/v1/adapters/second").json()
    assert got["version"] == 1
    tenant_dir = next(p for p in (data / "adapters").iterdir() if (p / "second").is_dir())
    assert sorted(p.name for p in (tenant_dir / "second").iterdir()) == ["v1"]
    monkeypatch.undo()
    r = upload(client, "second", adapter_dirs["b"])
    assert r.status_code == 201 and r.json()["version"] == 3, r.text
    assert complete(client, "second") != before
