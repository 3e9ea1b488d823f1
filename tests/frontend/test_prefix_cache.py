"""Prefix caching through the server: a tenant reuses what its own requests computed and no
other tenant's unless the admin lets both share (base model only), `cache_salt` narrows it
and hostile values are refused, and /metrics and `admin status` count the hits."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROMPT = [3 + (7 * i) % 290 for i in range(100)]  # 6 full blocks of 16 reusable (96 tokens)
REUSABLE = 96
HITS = "punica_x_prefix_cache_hits_tokens_total"


def complete(server, key: str, model: str, **extra) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, **extra}
    with server.http(key) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def hits_of(server, key: str, model: str, adapter: str = "", **extra) -> tuple[float, str]:
    """Tokens the request found cached (the runner's counter for `adapter`), its text."""
    before = server.metric(HITS, adapter=adapter)
    text = complete(server, key, model, **extra)["choices"][0]["text"]
    return server.metric(HITS, adapter=adapter) - before, text


def patch(server, name: str, body) -> object:
    with server.http(server.admin_token) as c:
        return c.patch(f"/admin/tenants/{name}", json=body)


def test_tenants_reuse_only_their_own_prefixes_unless_both_share(server, adapter_dirs):
    a, b = server.create_tenant("cache-a"), server.create_tenant("cache-b")
    base = server.model_id
    first, text = hits_of(server, a, base)
    assert first == 0
    assert hits_of(server, a, base) == (REUSABLE, text)  # the same tenant: reused
    assert hits_of(server, b, base) == (0, text)  # another tenant: computed again
    for name in ("cache-a", "cache-b"):
        r = patch(server, name, {"share_prefix_cache": True})
        assert r.status_code == 200 and r.json()["share_prefix_cache"] is True
        assert r.json()["weight"] == 1.0  # untouched
    assert hits_of(server, a, base)[0] == 0  # the shared scope is new
    assert hits_of(server, b, base) == (REUSABLE, text)  # ... and now b finds a's blocks
    # adapters never cross tenants, sharing or not
    for key in (a, b):
        assert server.upload(key, "style", adapter_dirs["a"]).status_code == 201
    tenant_ids = {}
    with server.http(server.admin_token) as c:
        for t in c.get("/admin/tenants").json()["data"]:
            tenant_ids[t["name"]] = t["id"]
    adapter_a, adapter_b = (f"t{tenant_ids[n]}/style" for n in ("cache-a", "cache-b"))
    assert hits_of(server, a, "style", adapter_a)[0] == 0
    assert hits_of(server, b, "style", adapter_b)[0] == 0
    assert hits_of(server, b, "style", adapter_b)[0] == REUSABLE
    assert patch(server, "cache-a", {"share_prefix_cache": False}).status_code == 200
    assert hits_of(server, a, base)[0] == REUSABLE  # its own scope again, still cached


def test_cache_salt_narrows_reuse_within_a_tenant(server):
    key = server.create_tenant("salted")
    base = server.model_id
    hits_of(server, key, base)
    assert hits_of(server, key, base, cache_salt="user-1")[0] == 0
    assert hits_of(server, key, base, cache_salt="user-1")[0] == REUSABLE
    assert hits_of(server, key, base, cache_salt="user-2")[0] == 0
    assert hits_of(server, key, base)[0] == REUSABLE  # no salt: the tenant's own scope
    body = {"model": base, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with server.http(key) as c:
        assert c.post("/v1/chat/completions", json={**body, "cache_salt": "s"}).status_code == 200


@pytest.mark.parametrize("salt", [123, "", "x" * 257, ["x"], {"a": 1}, True, 1.5], ids=repr)
def test_hostile_cache_salts_are_refused(server, salt):
    key = server.create_tenant(f"bad-salt-{abs(hash(repr(salt))) % 10**8}")
    body = {"model": server.model_id, "prompt": "hello", "max_tokens": 2, "cache_salt": salt}
    with server.http(key) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt"


def test_salts_as_json_escapes(server):
    """A NUL is a string like any other; a lone surrogate is not text: a clear 400 (pydantic's
    strict string), and the server goes on."""
    import json

    key = server.create_tenant("odd-salt")
    body = {"model": server.model_id, "prompt": "hello", "max_tokens": 2}
    headers = {"content-type": "application/json"}
    for salt, status in (("\u0000 NUL", 200), ("t\u0000salt:x", 200), ("\ud800 lone", 400)):
        raw = json.dumps({**body, "cache_salt": salt})  # ASCII: the escapes travel as text
        with server.http(key) as c:
            r = c.post("/v1/completions", content=raw, headers=headers)
        assert r.status_code == status, r.text
        if status == 400:
            assert r.json()["error"]["param"] == "cache_salt"


@pytest.mark.parametrize(
    "body",
    [{}, {"share_prefix_cache": "yes"}, {"share_prefix_cache": 1}, {"share_prefix_cache": None}],
    ids=repr,
)
def test_hostile_tenant_updates_are_refused(server, body):
    server.create_tenant(f"upd-{abs(hash(repr(body))) % 10**8}")
    name = f"upd-{abs(hash(repr(body))) % 10**8}"
    r = patch(server, name, body)
    assert r.status_code == 400, r.text


def test_metrics_and_admin_status_show_the_hit_rate(server):
    key = server.create_tenant("rated")
    for _ in range(2):
        complete(server, key, server.model_id, cache_salt="rated")
    assert server.metric("punica_x_prefix_cache_queries_total") > 0
    assert server.metric("punica_x_prefix_cache_hits_total") >= REUSABLE
    assert server.metric("punica_x_prefix_cache_queries_tokens_total", runner="runner-0") > 0
    assert server.metric("punica_x_runner_kv_blocks_cached", runner="runner-0") > 0
    cmd = [sys.executable, "-m", "frontend.cli", "admin", "status"]
    cmd += ["--url", server.url, "--data-dir", str(server.data_dir)]
    shown = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    row = next(line for line in shown.stdout.splitlines() if line.startswith("runner-0"))
    assert "%" in row
    assert "of" in shown.stdout.splitlines()[-1] and "%" in shown.stdout.splitlines()[-1]
    cmd = [sys.executable, "-m", "frontend.cli", "admin", "tenant", "share", "rated", "on"]
    cmd += ["--url", server.url, "--data-dir", str(server.data_dir)]
    shared = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert shared.returncode == 0 and "share_prefix_cache True" in shared.stdout
