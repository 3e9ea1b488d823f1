"""Lamina through the server: `serve --attention-workers 2` answers greedy completions of the
base model and of an adapter with the plain server's tokens and logprobs (float32), its runner
holding no KV; a worker count that does not divide the model's KV heads is refused with the
counts that would, and bad values of the flag stop the command."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from live_server import free_port, start_server

PROMPTS = [[3 + (5 * i + j) % 290 for i in range(20 + 9 * j)] for j in range(3)]


@pytest.fixture(scope="module")
def lamina_server(srv_model_dir, tmp_path_factory):
    srv = start_server(
        srv_model_dir, tmp_path_factory.mktemp("lamina") / "data", "--attention-workers", "2"
    )
    yield srv
    srv.stop()


def completions(srv, key: str, model: str) -> list[tuple[str, list[float]]]:
    out = []
    with srv.http(key, timeout=120) as c:
        for prompt in PROMPTS:
            body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
            r = c.post("/v1/completions", json={**body, "ignore_eos": True, "logprobs": 1})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            out.append((choice["text"], choice["logprobs"]["token_logprobs"]))
    return out


def assert_same(want, got) -> None:
    for (text, logprobs), (text2, logprobs2) in zip(want, got, strict=True):
        assert text == text2
        assert max(abs(a - b) for a, b in zip(logprobs, logprobs2, strict=True)) <= 1e-5


def test_base_and_adapter_outputs_equal_the_plain_server(lamina_server, server, adapter_dirs):
    key, lamina_key = server.create_tenant("lamina-ref"), lamina_server.create_tenant("lamina")
    assert server.upload(key, "lam", adapter_dirs["b"]).status_code == 201
    assert lamina_server.upload(lamina_key, "lam", adapter_dirs["b"]).status_code == 201
    for model in (server.model_id, "lam"):
        want = completions(server, key, model)
        assert_same(want, completions(lamina_server, lamina_key, model))


def test_admin_lists_the_model_worker_and_its_attention_workers(lamina_server):
    with lamina_server.http(lamina_server.admin_token) as c:
        (row,) = c.get("/admin/runners").json()["runners"]
    assert row["role"] == "model" and row["attention_worker_losses"] == 0
    workers = row["attention_workers"]
    assert [(w["role"], w["index"], w["kv_heads"]) for w in workers] == [
        ("attention", 0, [0, 1]),
        ("attention", 1, [1, 2]),
    ]
    assert len({row["pid"], *(w["pid"] for w in workers)}) == 3  # three processes
    assert all(w["kv_blocks_used"] == row["kv_blocks_used"] for w in workers)
    assert lamina_server.metric("punica_x_attention_worker_losses_total") == 0
    shown = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "admin", "status", "--url", lamina_server.url],
        capture_output=True,
        text=True,
        env={**os.environ, "PUNICA_X_ADMIN_TOKEN": lamina_server.admin_token},
    )
    assert shown.returncode == 0, shown.stderr
    lines = [line.split() for line in shown.stdout.splitlines()]
    assert [line[0] for line in lines[2:5]] == [
        "runner-0",
        "runner-0/attention-0",
        "runner-0/attention-1",
    ]
    assert lines[2][4] == "model" and lines[3][4] == "attention[0:1]"


def test_a_count_that_does_not_divide_the_kv_heads_is_refused(srv_model_dir, tmp_path):
    """The tiny Llama has 2 KV heads: 3 attention workers cannot split them. The model cannot
    be built, so the server exits 1 with the cause on stderr (issue 73: it used to stay up
    for ever, /ready saying 503, which an orchestrator reads as a slow start)."""
    port = free_port()
    cmd = [sys.executable, "-m", "frontend.cli", "serve", "--model", str(srv_model_dir)]
    cmd += ["--port", str(port), "--data-dir", str(tmp_path / "d"), "--attention-workers", "3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the server did not exit after its model failed to build")
    assert proc.returncode == 1, err[-2000:]
    assert "punica-x: cannot start: building the model failed" in err
    assert "cannot split this model's 2 KV heads" in err and "[1, 2]" in err, err[-2000:]


@pytest.mark.parametrize("bad", ["-1", "65", "x", "1.5", ""])
def test_bad_values_of_the_flag_stop_the_command(bad, tmp_path):
    cmd = [sys.executable, "-m", "frontend.cli", "serve", "--attention-workers", bad]
    r = subprocess.run(cmd + ["--data-dir", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "attention" in r.stderr
