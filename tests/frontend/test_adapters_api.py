"""Adapter upload as a first-class API: files or archives, versions swapped atomically,
deferred deletes, and tenant isolation."""

from __future__ import annotations

import io
import threading
import zipfile

from live_server import tar_gz

FILES = ("adapter_config.json", "adapter_model.safetensors")


def complete(server, key, model, prompt="hello world", n=12):
    with server.http(key) as c:
        r = c.post(
            "/v1/completions",
            json={
                "model": model,
                "prompt": prompt,
                "max_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_upload_files_and_read_back(server, adapter_dirs):
    key = server.create_tenant("uploader")
    r = server.upload(key, "alpha", adapter_dirs["a"])
    assert r.status_code == 201, r.text
    body = r.json()
    assert set(body) >= {"id", "name", "version", "rank", "target_modules", "sha256", "size_bytes"}
    assert (body["name"], body["version"], body["rank"]) == ("alpha", 1, 4)
    assert body["target_modules"] == ["q_proj", "v_proj"]
    assert body["size_bytes"] == sum((adapter_dirs["a"] / f).stat().st_size for f in FILES)
    with server.http(key) as c:
        assert c.get("/v1/adapters/alpha").json() == body
        assert [a["name"] for a in c.get("/v1/adapters").json()["data"]] == ["alpha"]
        models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert "alpha" in models and "weight_format" not in models["alpha"]
        base = models[server.model_id]  # the test server: a tiny float32 Llama
        assert base["weight_format"] == "float32" and base["weight_bytes"] > 1e5
    assert complete(server, key, "alpha") != complete(server, key, server.model_id)


def test_adapters_report_their_stored_and_serving_dtypes(server, adapter_dirs, tmp_path):
    """`dtype.stored` is what the uploaded safetensors hold, `dtype.serving` the runners'
    dtype the weights are cast to (the test server runs `--dtype float32`)."""
    from safetensors.torch import load_file, save_file

    serving = "float32"
    half = tmp_path / "half"
    half.mkdir()
    (half / FILES[0]).write_bytes((adapter_dirs["a"] / FILES[0]).read_bytes())
    weights = load_file(adapter_dirs["a"] / FILES[1])
    save_file({k: t.half() for k, t in weights.items()}, half / FILES[1])
    key = server.create_tenant("dtypes")
    r16, r32 = server.upload(key, "half", half), server.upload(key, "full", adapter_dirs["a"])
    assert r16.status_code == r32.status_code == 201, (r16.text, r32.text)
    assert r16.json()["dtype"] == {"stored": "float16", "serving": serving}
    assert r32.json()["dtype"] == {"stored": "float32", "serving": serving}
    with server.http(key) as c:
        listed = {a["name"]: a["dtype"] for a in c.get("/v1/adapters").json()["data"]}
        assert listed == {"full": r32.json()["dtype"], "half": r16.json()["dtype"]}
        assert c.get("/v1/adapters/half").json() == r16.json()
    # the float16 upload serves: its weights, cast to the serving dtype, change the output
    assert complete(server, key, "half") != complete(server, key, server.model_id)
    with server.http(key) as c:
        assert c.delete("/v1/adapters/half").json()["dtype"] == r16.json()["dtype"]


def test_upload_archives(server, adapter_dirs):
    key = server.create_tenant("archiver")
    members = {f"adapter/{f}": (adapter_dirs["b"] / f).read_bytes() for f in FILES}
    members["adapter/README.md"] = b"# PEFT card, ignored"
    zbuf = io.BytesIO()
    with zipfile.ZipFile(zbuf, "w") as zf:
        for f in FILES:
            zf.writestr(f, (adapter_dirs["b"] / f).read_bytes())
    with server.http(key) as c:
        for name, data in (("from-tar", tar_gz(members)), ("from-zip", zbuf.getvalue())):
            r = c.post("/v1/adapters", data={"name": name}, files={"archive": ("a.bin", data)})
            assert r.status_code == 201, r.text
            assert r.json()["rank"] == 8
        files = {f: (f, (adapter_dirs["b"] / f).read_bytes()) for f in FILES}
        r = c.post("/v1/adapters", data={"name": "from-files"}, files=files)
        assert r.status_code == 201, r.text
    # the archives carry the weights: same output as the plain upload, not the base model's
    from_files = complete(server, key, "from-files")
    assert complete(server, key, "from-tar") == complete(server, key, "from-zip") == from_files
    assert from_files != complete(server, key, server.model_id)


def test_new_version_swaps_atomically(server, adapter_dirs):
    """A stream that is certainly running when version 2 lands finishes on version 1;
    requests arriving during the swap get one version or the other, whole, never an error."""
    import json

    key = server.create_tenant("versioner")
    assert server.upload(key, "x", adapter_dirs["a"]).status_code == 201
    n = 1500
    old = complete(server, key, "x", n=n)
    old_short = complete(server, key, "x")
    body = {
        "model": "x",
        "prompt": "hello world",
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    pieces, arrivals, stop = [], [], threading.Event()

    def arrive():
        while not stop.is_set():
            arrivals.append(complete(server, key, "x"))  # asserts 200 itself

    with server.http(key) as c, c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()  # kept referenced: dropping it would close the stream
        for line in lines:
            if line.startswith("data: {"):
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
                break
        others = [threading.Thread(target=arrive) for _ in range(2)]
        for t in others:
            t.start()
        up = server.upload(key, "x", adapter_dirs["b"])  # replaces "x" while the stream runs
        assert up.status_code == 201 and up.json()["version"] == 2
        stop.set()
        for t in others:
            t.join(60)
        # the stream alone is still decoding after the swap returned: it landed mid-request
        assert server.metric("punica_x_batch_size") == 1
        for line in lines:
            if line.startswith("data: {"):
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(pieces) == old  # the running request finished on version 1
    new_short = complete(server, key, "x")
    assert new_short != old_short  # new requests use version 2
    assert arrivals and set(arrivals) <= {old_short, new_short}
    with server.http(key) as c:
        assert c.get("/v1/adapters/x").json()["version"] == 2


def test_delete_is_deferred_for_running_requests(server, adapter_dirs):
    """A request holding the adapter finishes on it after the DELETE; new ones get 404; the
    files go once that request is done (the server's collector runs every 5 s)."""
    import json
    import time

    key = server.create_tenant("deleter")
    assert server.upload(key, "gone-del", adapter_dirs["a"]).status_code == 201
    (files,) = server.data_dir.glob("adapters/*/gone-del/v1")
    expected = complete(server, key, "gone-del", n=300)
    body = {
        "model": "gone-del",
        "prompt": "hello world",
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    pieces = []
    with server.http(key) as c, c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()  # kept referenced: dropping it would close the stream
        for line in lines:
            if line.startswith("data: {"):
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
                break  # one token out: the request holds the adapter now
        with server.http(key) as d:
            assert d.delete("/v1/adapters/gone-del").status_code == 200
            r404 = d.post("/v1/completions", json={"model": "gone-del", "prompt": "hi"})
            assert r404.status_code == 404 and r404.json()["error"]["code"] == "model_not_found"
            assert d.get("/v1/adapters/gone-del").status_code == 404
        assert files.is_dir()  # still in use
        for line in lines:
            if line.startswith("data: {"):
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(pieces) == expected  # finished on the deleted adapter's weights
    deadline = time.monotonic() + 30  # a bound, not a timing assertion: the collector's period
    while files.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not files.exists()


def test_tenants_cannot_see_each_others_adapters(server, adapter_dirs):
    owner = server.create_tenant("owner")
    other = server.create_tenant("other")
    assert server.upload(owner, "private", adapter_dirs["a"]).status_code == 201
    with server.http(other) as c:
        missing = c.get("/v1/adapters/does-not-exist").json()
        for r in (c.get("/v1/adapters/private"), c.delete("/v1/adapters/private")):
            assert r.status_code == 404
            assert r.json()["error"]["code"] == missing["error"]["code"]
        assert c.get("/v1/adapters").json()["data"] == []
        assert "private" not in [m["id"] for m in c.get("/v1/models").json()["data"]]
        r = c.post("/v1/completions", json={"model": "private", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404
        same = c.post("/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2})
        assert r.json()["error"]["code"] == same.json()["error"]["code"] == "model_not_found"
    # the other tenant may use the same name for its own adapter
    assert server.upload(other, "private", adapter_dirs["b"]).status_code == 201
    assert complete(server, owner, "private") != complete(server, other, "private")


def test_listing_in_pages(server, adapter_dirs):
    """?limit=N&after=NAME pages the caller's adapters by name (a server of 10,000 adapters
    lists them without one 10,000-entry answer); bad paging parameters are 400."""
    key = server.create_tenant("pager")
    names = ["p0", "p1", "p2", "p3", "p4"]
    for name in reversed(names):
        assert server.upload(key, name, adapter_dirs["a"]).status_code == 201
    with server.http(key) as c:
        assert [a["name"] for a in c.get("/v1/adapters").json()["data"]] == names
        seen, after, pages = [], None, 0
        while True:
            params = {"limit": 2} if after is None else {"limit": 2, "after": after}
            body = c.get("/v1/adapters", params=params).json()
            seen += [a["name"] for a in body["data"]]
            assert body["first_id"] == body["data"][0]["name"]
            assert body["last_id"] == body["data"][-1]["name"]
            pages += 1
            if not body["has_more"]:
                break
            after = body["last_id"]
        assert seen == names and pages == 3
        body = c.get("/v1/adapters", params={"limit": 1000, "after": "p4"}).json()
        assert body == {
            "object": "list",
            "data": [],
            "has_more": False,
            "first_id": None,
            "last_id": None,
        }
        bad = [
            {"limit": 0},
            {"limit": 1001},
            {"limit": -1},
            {"limit": "a"},
            {"limit": "1e3"},
            {"limit": " 1"},
            {"limit": ""},
            {"limit": "9" * 40},
            {"after": "p1"},
            {"limit": 2, "after": "../x"},
            {"limit": 2, "after": "a" * 65},
            {"limit": 2, "offset": 1},
        ]
        for params in bad:
            r = c.get("/v1/adapters", params=params)
            assert r.status_code == 400, (params, r.text)
    other = server.create_tenant("pager2")
    with server.http(other) as c:  # another tenant's names are never paged through
        assert c.get("/v1/adapters", params={"limit": 10}).json()["data"] == []
    _admin_lists_in_pages(server, names, key)


def _admin_lists_in_pages(server, names, key):
    """The admin reads any tenant's adapters the same way (GET /admin/tenants/{name}/adapters),
    and `punica-x admin tenant adapters NAME` pages through all of them."""
    import httpx

    admin = {"Authorization": f"Bearer {server.admin_token}"}
    url = server.url + "/admin/tenants/pager/adapters"
    assert [a["name"] for a in httpx.get(url, headers=admin).json()["data"]] == names
    page = httpx.get(url, params={"limit": 2, "after": "p1"}, headers=admin).json()
    assert ([a["name"] for a in page["data"]], page["has_more"]) == (["p2", "p3"], True)
    for params in ({"limit": 0}, {"after": "p1"}, {"limit": 2, "offset": 1}):
        assert httpx.get(url, params=params, headers=admin).status_code == 400, params
    missing = httpx.get(server.url + "/admin/tenants/nobody/adapters", headers=admin)
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "tenant_not_found")
    assert httpx.get(url, headers={"Authorization": f"Bearer {key}"}).status_code == 401


def test_admin_cli_lists_a_tenants_adapters_page_by_page(server, adapter_dirs, monkeypatch, capsys):
    from frontend import cli_admin

    key = server.create_tenant("listed")
    for name in ("l0", "l1", "l2"):
        assert server.upload(key, name, adapter_dirs["a"]).status_code == 201
    monkeypatch.setattr(cli_admin, "ADAPTER_PAGE", 2)  # two pages of two and one
    calls = []
    real = cli_admin._call
    monkeypatch.setattr(cli_admin, "_call", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    assert cli_admin._adapters(server.url, server.admin_token, "listed") == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[:3] for line in lines] == [
        ["l0", "v1", "rank 4"], ["l1", "v1", "rank 4"], ["l2", "v1", "rank 4"]
    ]  # fmt: skip
    assert all(line.endswith("\tupload") for line in lines) and len(calls) == 2
    assert cli_admin._adapters(server.url, server.admin_token, "nobody") == 1


def test_pinning_an_adapter(server, adapter_dirs):
    """PATCH /v1/adapters/{name} {"pinned": bool}: the runners keep it on their devices; a
    new version stays pinned; a tenant pins at most max_pinned_per_tenant (4); bad bodies
    are 400, names not the caller's 404."""
    key, other = server.create_tenant("pinner"), server.create_tenant("pinner2")
    for name in ("pa", "pb", "pc", "pd", "pe"):
        assert server.upload(key, name, adapter_dirs["a"]).status_code == 201
    with server.http(key) as c:
        r = c.patch("/v1/adapters/pa", json={"pinned": True})
        assert r.status_code == 200 and r.json()["pinned"] is True, r.text
        assert c.get("/v1/adapters/pa").json()["pinned"] is True
        assert c.get("/v1/adapters/pb").json()["pinned"] is False
        assert server.upload(key, "pa", adapter_dirs["b"]).json()["pinned"] is True  # v2
        assert complete(server, key, "pa")
        for name in ("pb", "pc", "pd"):
            assert c.patch(f"/v1/adapters/{name}", json={"pinned": True}).status_code == 200
        r = c.patch("/v1/adapters/pe", json={"pinned": True})
        assert r.status_code == 403 and r.json()["error"]["code"] == "pin_quota_exceeded"
        assert c.patch("/v1/adapters/pd", json={"pinned": False}).json()["pinned"] is False
        assert c.patch("/v1/adapters/pe", json={"pinned": True}).status_code == 200
        assert c.patch("/v1/adapters/pe", json={"pinned": True}).status_code == 200  # again
        bad = [{}, {"pinned": "yes"}, {"pinned": 1}, {"pinned": None}, {"pinned": True, "x": 1}]
        for body in bad:
            assert c.patch("/v1/adapters/pb", json=body).status_code == 400, body
        assert c.patch("/v1/adapters/pb", content=b"{nope").status_code == 400
        assert c.patch("/v1/adapters/pb", json=[{"pinned": True}]).status_code == 400
        assert c.patch("/v1/adapters/missing", json={"pinned": True}).status_code == 404
        pinned = {a["name"] for a in c.get("/v1/adapters").json()["data"] if a["pinned"]}
        assert pinned == {"pa", "pb", "pc", "pe"}
    with server.http(other) as c:
        assert c.patch("/v1/adapters/pa", json={"pinned": False}).status_code == 404
