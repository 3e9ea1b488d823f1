"""GET /openapi.json describes every route from the same pydantic models that validate the
bodies, and schemathesis, generating valid and invalid requests from it, finds no 5xx on
any route (completions, chat, models, adapters, admin); the server is ready afterwards and
still answers a reference request with the same tokens. Bounded here; `make test-long` runs
many more examples and stateful sequences (FUZZ_LONG=1)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from live_server import start_server

# make test: examples, boundary values and a few random bodies per route (~1 min);
# make test-long sets FUZZ_LONG=1: many more, and stateful sequences, for up to 10 minutes.
LONG = os.environ.get("FUZZ_LONG") == "1"
EXAMPLES = 200 if LONG else 12
PHASES = "examples,coverage,fuzzing,stateful" if LONG else "examples,coverage,fuzzing"
MAX_TIME = 600 if LONG else 300


@pytest.fixture(scope="module")
def fuzz_server(srv_model_dir, tmp_path_factory):
    """A server of its own: schemathesis creates tenants and starts and drains runners."""
    srv = start_server(
        srv_model_dir,
        tmp_path_factory.mktemp("fuzz") / "data",
        *("--limit", "max_tokens=16", "--limit", "max_runners=2"),
        # the dynamic LoRA routes on, over a folder with nothing in it
        *("--lora-source-root", str(tmp_path_factory.mktemp("fuzz-sources"))),
    )
    yield srv
    srv.stop()


def reference(srv, key) -> str:
    body = {"model": srv.model_id, "prompt": "hello world", "max_tokens": 8, "temperature": 0}
    with srv.http(key) as c:
        r = c.post("/v1/completions", json={**body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_openapi_lists_every_route_with_its_body_schema(server):
    with server.http() as c:
        doc = c.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    paths = doc["paths"]
    for path, method in [
        ("/v1/completions", "post"),
        ("/v1/chat/completions", "post"),
        ("/v1/models", "get"),
        ("/v1/adapters", "post"),
        ("/v1/adapters/{name}", "delete"),
        ("/v1/load_lora_adapter", "post"),
        ("/v1/unload_lora_adapter", "post"),
        ("/admin/tenants", "post"),
        ("/admin/runners", "post"),
    ]:
        assert method in paths[path], (path, method)
    schemas = doc["components"]["schemas"]
    completion = schemas["CompletionRequest"]
    assert completion["additionalProperties"] is False
    assert set(completion["required"]) == {"model", "prompt"}
    assert {"seed", "temperature", "min_tokens", "stop_token_ids"} <= set(completion["properties"])
    body = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}


def schemathesis(srv, token: str, include: str, cwd: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "schemathesis"
    cmd = [
        str(exe),
        "run",
        srv.url + "/openapi.json",
        "--checks",
        "not_a_server_error",
        "--max-examples",
        str(EXAMPLES),
        "--phases",
        PHASES,
        "--request-timeout",
        "60",
        "--seed",
        "1",
        "--no-shrink",
        "--include-path-regex",
        include,
        "-H",
        f"Authorization: Bearer {token}",
    ]
    if LONG:
        cmd += ["--max-time", str(MAX_TIME)]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "", "NO_COLOR": "1"}
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=MAX_TIME + 120, env=env, cwd=cwd
    )


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(fuzz_server, tmp_path):
    srv = fuzz_server
    key = srv.create_tenant("fuzzer")
    expected = reference(srv, key)
    runs = [
        schemathesis(srv, key, r"^/(v1/.*|health|ready|openapi\.json)$", tmp_path),
        schemathesis(srv, srv.admin_token, r"^/(admin/.*|metrics)$", tmp_path),
    ]
    for run in runs:
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
        generated = re.search(r"(\d+) generated, (\d+) passed", run.stdout)
        assert generated and generated[1] == generated[2] and int(generated[1]) > 100, run.stdout
    with srv.http() as c:
        assert c.get("/ready").status_code == 200
    assert reference(srv, key) == expected
    assert srv.metric("punica_x_runner_restarts_total") == 0
