"""Bad uploads get a 4xx with a stable error code before anything reaches a runner, and the
server keeps streaming to other tenants meanwhile."""

from __future__ import annotations

import io
import json
import socket
import threading
import zipfile

import pytest
from helpers import make_peft_adapter, make_tiny_llama, trojan_checkpoint
from live_server import tar_gz
from safetensors.torch import load_file, save_file

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@pytest.fixture(scope="module")
def key(server):
    return server.create_tenant("refused")


def files_of(folder):
    return {f: (folder / f).read_bytes() for f in (CONFIG, WEIGHTS)}


def post(server, key, name="bad", files=None, archive=None):
    with server.http(key) as c:
        if archive is not None:
            return c.post("/v1/adapters", data={"name": name}, files={"archive": ("x", archive)})
        return c.post(
            "/v1/adapters", data={"name": name}, files={k: (k, v) for k, v in files.items()}
        )


def refused(r, status, code):
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code, r.text


def test_pickles_are_refused_and_never_unpickled(server, key, adapter_dirs, tmp_path):
    marker = tmp_path / "pwned-by-pickle"
    files = files_of(adapter_dirs["a"])
    pickled = trojan_checkpoint(adapter_dirs["a"] / WEIGHTS, marker)
    rows = adapter_rows(server)
    bin_ = "adapter_model.bin"
    for upload, code in (
        # beside good weights (a loader reading every checkpoint in the folder), or alone
        (dict(archive=tar_gz({**files, bin_: pickled})), "pickle_not_allowed"),
        (dict(archive=tar_gz({CONFIG: files[CONFIG], bin_: pickled})), "pickle_not_allowed"),
        (dict(files={CONFIG: files[CONFIG], bin_: pickled}), "invalid_upload"),
        (dict(files={CONFIG: files[CONFIG], WEIGHTS: pickled}), "bad_weights"),  # renamed
    ):
        r = post(server, key, **upload)
        assert not marker.exists(), f"an uploaded pickle was unpickled ({r.text})"
        refused(r, 400, code)
    assert adapter_rows(server) == rows


def test_body_cap_refused_without_reading_the_body(server, key):
    # A Content-Length over the cap is answered at once, with almost nothing sent.
    with socket.create_connection(
        ("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=10
    ) as s:
        s.sendall(
            b"POST /v1/adapters HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + key.encode()
            + b"\r\nContent-Type: multipart/form-data; boundary=b\r\n"
            b"Content-Length: 999999999\r\n\r\n--b\r\n"
        )
        reply = b""
        while b"payload_too_large" not in reply and (chunk := s.recv(65536)):
            reply += chunk
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413") and "payload_too_large" in reply

    # Without a Content-Length (chunked), the cap is enforced while streaming.
    def chunks():
        yield b'--b\r\nContent-Disposition: form-data; name="name"\r\n\r\nbig\r\n'
        yield b'--b\r\nContent-Disposition: form-data; name="archive"; filename="x"\r\n\r\n'
        for _ in range(10):
            yield b"\0" * 1_000_000

    with server.http(key) as c:
        r = c.post(
            "/v1/adapters",
            content=chunks(),
            headers={"Content-Type": "multipart/form-data; boundary=b"},
        )
    refused(r, 413, "payload_too_large")


@pytest.mark.parametrize(
    ("members", "links", "code"),
    [
        ({"../adapter_config.json": b"{}", WEIGHTS: b"x"}, None, "unsafe_archive"),
        ({"/etc/adapter_config.json": b"{}", WEIGHTS: b"x"}, None, "unsafe_archive"),
        ({CONFIG: b"{}"}, {WEIGHTS: "/etc/passwd"}, "unsafe_archive"),
        ({f"d{i}/README.md": b"" for i in range(12)}, None, "too_many_entries"),
        ({CONFIG: b"{}", WEIGHTS: b"x", "evil.py": b"import os"}, None, "unexpected_file"),
        ({CONFIG: b"{}"}, None, "missing_file"),
    ],
)
def test_unsafe_archives_are_refused(server, key, members, links, code):
    refused(post(server, key, archive=tar_gz(members, links)), 400, code)


def test_zip_symlink_and_bombs_are_refused(server, key):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        info = zipfile.ZipInfo(WEIGHTS)
        info.external_attr = 0o120777 << 16  # a symlink
        zf.writestr(info, "/etc/passwd")
        zf.writestr(CONFIG, "{}")
    refused(post(server, key, archive=buf.getvalue()), 400, "unsafe_archive")
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(CONFIG, "{}")
        zf.writestr(WEIGHTS, b"\0" * 5_000_000)  # a few KB compressed, over the unpacked cap
    assert len(bomb.getvalue()) < 100_000
    refused(post(server, key, archive=bomb.getvalue()), 413, "archive_too_large")
    refused(post(server, key, archive=b"not an archive"), 400, "invalid_archive")


def adapter_rows(server) -> int:
    """Rows of the adapter table, whatever their state (read-only, beside the server)."""
    import sqlite3

    db = sqlite3.connect(f"file:{server.data_dir / 'punica-x.sqlite3'}?mode=ro", uri=True)
    try:
        return db.execute("SELECT COUNT(*) FROM adapters").fetchone()[0]
    finally:
        db.close()


def test_runner_checks_apply_before_the_runner(server, key, adapter_dirs, tmp_path):
    rows = adapter_rows(server)
    files = files_of(adapter_dirs["b"])
    config = json.loads(files[CONFIG])
    refused(
        post(server, key, files={**files, CONFIG: json.dumps({**config, "r": 999}).encode()}),
        400,
        "rank_too_large",
    )
    refused(
        post(
            server, key, files={**files, CONFIG: json.dumps({**config, "use_dora": True}).encode()}
        ),
        400,
        "dora_not_supported",
    )
    weights = load_file(adapter_dirs["b"] / WEIGHTS)
    name = sorted(weights)[0]
    weights[name] = weights[name].clone()
    weights[name][0, 0] = float("inf")
    save_file(weights, tmp_path / "nan.safetensors")
    refused(
        post(server, key, files={**files, WEIGHTS: (tmp_path / "nan.safetensors").read_bytes()}),
        400,
        "non_finite",
    )
    from transformers import AutoModelForCausalLM

    other = make_tiny_llama(tmp_path / "other", hidden_size=32, intermediate_size=64)
    wrong = make_peft_adapter(
        AutoModelForCausalLM.from_pretrained(other), tmp_path / "w", 4, ["q_proj"], 3
    )
    refused(post(server, key, files=files_of(wrong)), 400, "shape_mismatch")
    refused(post(server, key, files={CONFIG: b"{nope", WEIGHTS: files[WEIGHTS]}), 400, "bad_config")
    refused(post(server, key, name="../escape", files=files), 400, "invalid_name")
    with server.http(key) as c:
        assert c.get("/v1/adapters").json()["data"] == []  # nothing half-registered
    # refused before any version was reserved for the runners (not even a pending row that
    # was then aborted), and nothing left on disk. The runners are only ever given reserved
    # versions, so this is what shows they were not reached (punica_x_adapter_loads_total
    # would not: it counts device loads at first use, and stays put when a runner refuses)
    assert adapter_rows(server) == rows
    assert list((server.data_dir / "staging").iterdir()) == []


def test_oversized_config_is_refused_and_one_just_under_the_cap_is_not(server, key, adapter_dirs):
    files = files_of(adapter_dirs["a"])
    config = json.loads(files[CONFIG])

    def padded(size):
        body = json.dumps({**config, "padding": ""}).encode()
        out = json.dumps({**config, "padding": "x" * (size - len(body))}).encode()
        assert len(out) == size
        return out

    rows = adapter_rows(server)
    big = padded(1536 * 1024)  # fits the test server's 4 MB body cap, not the 1 MiB config cap
    refused(post(server, key, files={**files, CONFIG: big}), 413, "config_too_large")
    archive = tar_gz({CONFIG: big, WEIGHTS: files[WEIGHTS]})
    refused(post(server, key, archive=archive), 413, "config_too_large")
    assert adapter_rows(server) == rows
    ok = post(server, key, name="padded", files={**files, CONFIG: padded((1 << 20) - 64)})
    assert ok.status_code == 201, ok.text


def complete(server, key, model) -> str:
    body = {"model": model, "prompt": "hello world", "max_tokens": 12, "temperature": 0}
    with server.http(key) as c:
        r = c.post("/v1/completions", json={**body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_config_code_fields_are_never_acted_on(server, adapter_dirs, tmp_path):
    """Config fields that make a naive loader run code (transformers' auto_map with
    trust_remote_code, peft's auto_mapping importing parent_library, a shell in
    base_model_name_or_path): the module they name, shipped in the archive, is refused; the
    config alone is accepted, its fields ignored, and the adapter serves its weights."""
    key = server.create_tenant("code-fields")
    marker = tmp_path / "pwned-by-config"
    files = files_of(adapter_dirs["a"])
    config = json.loads(files[CONFIG])
    config["auto_map"] = {"AutoModel": "evil.Model", "AutoConfig": "evil.Config"}
    config["auto_mapping"] = {"base_model_class": "Model", "parent_library": "evil"}
    config["base_model_name_or_path"] = f"/nonexistent; touch {marker}"
    config_bytes = json.dumps(config).encode()
    evil = f"open({str(marker)!r}, 'w').close()\nclass Model: pass\nclass Config: pass\n"
    archive = tar_gz({CONFIG: config_bytes, WEIGHTS: files[WEIGHTS], "evil.py": evil.encode()})
    r = post(server, key, name="evil", archive=archive)
    assert not marker.exists(), f"the module auto_map names was run ({r.text})"
    refused(r, 400, "unexpected_file")
    r = post(server, key, name="automap", files={**files, CONFIG: config_bytes})
    assert r.status_code == 201, r.text
    assert server.upload(key, "plain", adapter_dirs["a"]).status_code == 201
    served = complete(server, key, "automap")  # loads it onto the runner and runs it
    assert served == complete(server, key, "plain")
    assert served != complete(server, key, server.model_id)  # the weights were used
    assert not marker.exists(), "a config field was acted on"


def test_other_tenants_keep_streaming_during_refusals(server, adapter_dirs):
    key = server.create_tenant("bystander")
    bad = server.create_tenant("attacker")
    chunks = []
    body = {
        "model": server.model_id,
        "prompt": "hello",
        "max_tokens": 300,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }

    def stream():
        with server.http(key) as c, c.stream("POST", "/v1/completions", json=body) as r:
            chunks.extend(
                json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")
            )

    t = threading.Thread(target=stream)
    t.start()
    for _ in range(5):
        refused(post(server, bad, archive=tar_gz({"../x": b""})), 400, "unsafe_archive")
        refused(post(server, bad, files={CONFIG: b"{", WEIGHTS: b"junk"}), 400, "bad_config")
    t.join(60)
    assert chunks[-1]["usage"]["completion_tokens"] == 300
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_an_adapter_made_for_another_family_is_refused_naming_it(server, key, adapter_dirs):
    """A Phi-3 adapter (its fused qkv_proj) uploaded for this Llama base: 400 naming the base
    model's family and the modules it has."""
    files = files_of(adapter_dirs["a"])
    weights = {
        name.replace("q_proj", "qkv_proj"): t
        for name, t in load_bytes(files[WEIGHTS]).items()
        if "q_proj" in name
    }
    config = json.loads(files[CONFIG])
    config["target_modules"] = ["qkv_proj"]
    r = post(
        server,
        key,
        "phi3-adapter",
        {CONFIG: json.dumps(config).encode(), WEIGHTS: dump_bytes(weights)},
    )
    refused(r, 400, "unknown_module")
    assert "this llama base model's modules are q_proj" in r.json()["error"]["message"]


def load_bytes(data: bytes) -> dict:
    from safetensors.torch import load

    return load(data)


def dump_bytes(tensors: dict) -> bytes:
    from safetensors.torch import save

    return save(tensors)
