"""Auth on every route, admin-only routes, the admin CLI, and state surviving a restart."""

from __future__ import annotations

import stat
import subprocess
import sys

import httpx
import pytest
from live_server import start_server

ROUTES = [
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/adapters"),
    ("GET", "/v1/adapters"),
    ("GET", "/v1/adapters/x"),
    ("DELETE", "/v1/adapters/x"),
    ("GET", "/metrics"),
    ("GET", "/admin/tenants"),
    ("POST", "/admin/tenants"),
    ("DELETE", "/admin/tenants/x"),
    ("GET", "/admin/tenants/x/adapters"),
]


def test_health_and_ready_need_no_key(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").status_code == 200


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_every_route_needs_a_key(server, method, path):
    for headers in ({}, {"Authorization": "Bearer pxk-not-a-key"}, {"Authorization": "Basic abc"}):
        r = httpx.request(method, server.url + path, headers=headers)
        assert r.status_code == 401, (method, path, headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error"


def test_admin_routes_refuse_tenant_keys(server):
    key = server.create_tenant("plain-tenant")
    with server.http(key) as c:
        assert c.get("/v1/models").status_code == 200
        assert c.get("/admin/tenants").status_code == 401
        assert c.get("/metrics").status_code == 401
        assert c.post("/admin/tenants", json={"name": "sneaky"}).status_code == 401


def test_admin_token_file_is_private(server):
    mode = stat.S_IMODE((server.data_dir / "admin_token").stat().st_mode)
    assert mode == 0o600


def test_cli_creates_lists_and_revokes_tenants(server):
    def cli(*args):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "frontend.cli",
                "admin",
                "tenant",
                *args,
                "--url",
                server.url,
                "--data-dir",
                str(server.data_dir),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )

    created = cli("create", "cli-tenant")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert key.startswith("pxk-")
    with server.http(key) as c:
        assert c.get("/v1/models").status_code == 200
    listed = cli("list")
    assert "cli-tenant\tactive" in listed.stdout
    assert cli("create", "cli-tenant").returncode == 1  # 409: exists
    assert cli("revoke", "cli-tenant").returncode == 0
    assert "cli-tenant\trevoked" in cli("list").stdout
    with server.http(key) as c:
        assert c.get("/v1/models").status_code == 401


def test_state_survives_a_restart(srv_model_dir, adapter_dirs, tmp_path):
    data = tmp_path / "data"
    first = start_server(srv_model_dir, data)
    try:
        key = first.create_tenant("durable")
        assert first.upload(key, "mine", adapter_dirs["a"]).status_code == 201
        body = {"model": "mine", "prompt": "hello world", "max_tokens": 8, "temperature": 0}
        with first.http(key) as c:
            before = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
    finally:
        first.stop()
    second = start_server(srv_model_dir, data)
    try:
        with second.http(key) as c:
            names = [m["id"] for m in c.get("/v1/models").json()["data"]]
            assert "mine" in names
            assert c.post("/v1/completions", json=body).json()["choices"][0]["text"] == before
        assert second.admin_token == first.admin_token
    finally:
        second.stop()
