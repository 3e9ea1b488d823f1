"""A corpus of malformed requests from a tenant who wants to hurt the others: wrong types,
non-finite and extreme numbers, out-of-range sampling values, unknown and unsupported fields,
bad schemas and prompts, raw bodies that are not JSON objects, too deep or too big, bad
websocket frames and admin bodies. Each is answered 4xx with an OpenAI-shaped error naming
the field; none reaches a runner's step loop: afterwards every runner is active, none was
restarted, and a reference request produces exactly the tokens it produced before. Edge
values that are valid (temperature 1e-40, any 64-bit seed, ...) are served."""

from __future__ import annotations

import json

import pytest
from websockets.sync.client import connect

BIG = 2**64
DEEP = "[" * 100_000 + "]" * 100_000


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# (field, value) pairs sent in an otherwise valid completions body; each must be a 400
# naming `field` (the param of the error).
BAD_FIELDS = [
    ("model", 1),
    ("model", None),
    ("model", ""),
    ("model", ["x"]),
    ("prompt", 1),
    ("prompt", None),
    ("prompt", {}),
    ("prompt", []),
    ("prompt", [True, 2]),
    ("prompt", [1.5]),
    ("prompt", [-1]),
    ("prompt", [[]]),
    ("prompt", [[1], "x"]),
    ("prompt", ["x"] * 17),
    ("prompt", [BIG]),
    ("max_tokens", "8"),
    ("max_tokens", 8.0),
    ("max_tokens", True),
    ("max_tokens", -1),
    ("max_tokens", 2**40),
    ("max_tokens", 0),
    ("temperature", "hot"),
    ("temperature", -1),
    ("temperature", 3),
    ("temperature", True),
    ("temperature", [1]),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_p", "1"),
    ("top_k", -5),
    ("top_k", 1.5),
    ("top_k", "3"),
    ("top_k", 2**40),
    ("min_p", -0.1),
    ("min_p", 2),
    ("presence_penalty", 3),
    ("frequency_penalty", -3),
    ("frequency_penalty", "x"),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1),
    ("repetition_penalty", 1e308),
    ("seed", "x"),
    ("seed", 1.5),
    ("seed", True),
    ("seed", BIG),
    ("seed", -(2**63) - 1),
    ("seed", 1e20),
    ("stop", 1),
    ("stop", [1]),
    ("stop", [""]),
    ("stop", ["a"] * 5),
    ("stop", "x" * 10_000),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", "x"),
    ("stop_token_ids", [1.5]),
    ("stop_token_ids", [2**40]),
    ("stop_token_ids", list(range(100))),
    ("n", 0),
    ("n", 5),
    ("n", "2"),
    ("n", True),
    ("n", 10**6),
    ("best_of", 3),
    ("stream", "yes"),
    ("stream", 1),
    ("stream_options", {"include_usage": True}),  # without stream: true
    ("logprobs", 21),
    ("logprobs", -1),
    ("logprobs", True),
    ("logprobs", "1"),
    ("echo", "yes"),
    ("logit_bias", [1, 2]),
    ("logit_bias", {"a": 1}),
    ("logit_bias", {"-1": 1}),
    ("logit_bias", {"5": 101}),
    ("logit_bias", {"5": "1"}),
    ("logit_bias", {"99999999": 1}),
    ("logit_bias", {str(i): 1 for i in range(301)}),
    ("response_format", "json"),
    ("response_format", {"type": "yaml"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": 1}}),
    (
        "response_format",
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    ),
    ("suffix", "!"),
    ("tools", [{"type": "function"}]),
    ("functions", [{}]),
    ("tool_choice", "auto"),
    ("not_a_field", 1),
    ("user", 1),
    ("user", "x" * 1000),
    ("min_tokens", -1),
    ("min_tokens", "1"),
    ("min_tokens", 100),  # above max_tokens
    ("ignore_eos", "yes"),
    ("ignore_eos", 1),
    ("skip_special_tokens", 0),
    ("include_stop_str_in_output", "no"),
    ("cache_salt", 1),
    ("cache_salt", ""),
    ("cache_salt", "x" * 257),
    ("cache_salt", ["x"]),
    ("cache_salt", {"salt": "x"}),
    ("cache_salt", True),
]

BAD_CHAT_FIELDS = [
    ("messages", None),
    ("messages", []),
    ("messages", "hi"),
    ("messages", [{}]),
    ("messages", [{"role": "wizard", "content": "x"}]),
    ("messages", [{"role": "user", "content": 1}]),
    ("messages", [{"role": "user", "content": None}]),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
    ("messages", [{"role": "user", "content": "x", "name": "me"}]),
    ("messages", [{"role": "user", "content": "x"}] * 2000),
    ("logprobs", 3),
    ("top_logprobs", 2),  # without logprobs: true
    ("max_completion_tokens", "5"),
    ("echo", True),  # a completions field
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
]

# raw bodies of POST /v1/completions: (body bytes, expected status)
RAW_BODIES = [
    (b"", 400),
    (b"{not json", 400),
    (b"[1, 2]", 400),
    (b'"a string"', 400),
    (b"null", 400),
    (b'{"model": "m", "prompt": "x", "temperature": NaN}', 400),
    (b'{"model": "m", "prompt": "x", "temperature": Infinity}', 400),
    (b'{"model": "m", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400),
    (b'{"model": "m", "prompt": "x", "max_tokens": 1e400}', 400),
    (b'{"model": "m", "prompt": "\xff\xfe"}', 400),
    (DEEP.encode(), 400),
    (b'{"model": "m", "prompt": ' + DEEP.encode() + b"}", 400),
    (b'{"a": ' + b"{" * 40 + b"}" * 40 + b"}", 400),
]

# valid edge values: served (200), none ending in error
EDGE_VALID = [
    {"temperature": 1e-40},
    {"temperature": 5e-324},
    {"temperature": 0.7, "seed": -(2**63)},
    {"temperature": 0.7, "seed": 2**64 - 1},
    {"temperature": 0.7, "seed": -5},
    {"temperature": 2, "top_k": -1, "top_p": 1e-9},
    {"temperature": 0.7, "min_p": 1.0},
    {"repetition_penalty": 10, "frequency_penalty": 2, "presence_penalty": -2},
    {"repetition_penalty": 1e-9},
    {"logit_bias": {"5": 100, "6": -100}},
    {"min_tokens": 4, "stop_token_ids": [0, 1, 2]},
    {"best_of": 1, "n": 1, "user": "someone", "suffix": None, "tools": None},
    {"stream": True, "stream_options": {"include_usage": True}},
    {"skip_special_tokens": False, "include_stop_str_in_output": True, "stop": ["zzzz"]},
    {"cache_salt": "x" * 256},
]


@pytest.fixture(scope="module")
def tenant(server):
    return server.create_tenant("hostile")


def reference(server, key) -> list:
    body = {"model": server.model_id, "prompt": "hello world", "max_tokens": 12}
    body.update(temperature=0, ignore_eos=True, logprobs=0)
    with server.http(key) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def healthy(server, key, expected: list) -> None:
    """Every runner active and never restarted, and the reference tokens unchanged."""
    with server.http(server.admin_token) as c:
        rows = c.get("/admin/runners").json()["runners"]
    assert rows and all(r["state"] == "active" and r["error"] is None for r in rows), rows
    assert server.metric("punica_x_runner_restarts_total") == 0
    assert reference(server, key) == expected


def refused(r, status: int = 400, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def test_malformed_completions_are_refused_and_hurt_nobody(server, tenant):
    expected = reference(server, tenant)
    base = {"model": server.model_id, "prompt": "hello", "max_tokens": 4}
    with server.http(tenant) as c:
        for field, value in BAD_FIELDS:
            body = {**base, field: value}
            error = refused(c.post("/v1/completions", json=body), param=field)
            if field in ("suffix", "tools", "functions", "tool_choice", "not_a_field"):
                assert error["code"] == "unsupported_parameter", error
    healthy(server, tenant, expected)


def test_malformed_chat_bodies_are_refused(server, tenant):
    expected = reference(server, tenant)
    base = {"model": server.model_id, "messages": [{"role": "user", "content": "hi"}]}
    with server.http(tenant) as c:
        for field, value in BAD_CHAT_FIELDS + BAD_FIELDS[4:]:
            if field == "prompt" or (field, value) == ("logprobs", True):  # valid in chat
                continue
            body = {**base, "max_tokens": 4, field: value}
            refused(c.post("/v1/chat/completions", json=body), param=field)
    healthy(server, tenant, expected)


def test_raw_bodies_that_are_not_json_objects(server, tenant):
    expected = reference(server, tenant)
    headers = {"Content-Type": "application/json"}
    with server.http(tenant) as c:
        for raw, status in RAW_BODIES:
            for path in ("/v1/completions", "/v1/chat/completions"):
                error = refused(c.post(path, content=raw, headers=headers), status)
                assert error["code"] == "invalid_json", (raw[:60], error)
        too_big = b'{"model": "x", "prompt": "' + b"a" * (9 << 20) + b'"}'
        assert refused(c.post("/v1/completions", content=too_big), 413)["code"] == (
            "payload_too_large"
        )
    healthy(server, tenant, expected)


def test_valid_edge_values_are_served(server, tenant):
    expected = reference(server, tenant)
    base = {"model": server.model_id, "prompt": "hello", "max_tokens": 6, "ignore_eos": True}
    with server.http(tenant) as c:
        for extra in EDGE_VALID:
            r = c.post("/v1/completions", json={**base, **extra})
            assert r.status_code == 200, (extra, r.text)
            if not extra.get("stream"):
                choice = r.json()["choices"][0]
                assert choice["finish_reason"] in ("length", "stop"), (extra, choice)
            else:
                assert '"finish_reason":"length"' in r.text and "data: [DONE]" in r.text
        greedy = {**base, "temperature": 0}
        tiny = {**base, "temperature": 1e-40}
        assert (
            c.post("/v1/completions", json=greedy).json()["choices"][0]["text"]
            == (c.post("/v1/completions", json=tiny).json()["choices"][0]["text"])
        )
        seeded = {**base, "temperature": 1.0, "seed": 2**64 - 1}
        first = c.post("/v1/completions", json=seeded).json()["choices"][0]["text"]
        assert c.post("/v1/completions", json=seeded).json()["choices"][0]["text"] == first
    healthy(server, tenant, expected)


def test_malformed_websocket_frames(server, tenant):
    expected = reference(server, tenant)
    url = server.url.replace("http://", "ws://") + f"/v1/chat/ws?token={tenant}"
    base = {"type": "chat", "model": server.model_id, "max_tokens": 4}
    base["messages"] = [{"role": "user", "content": "hi"}]
    frames = [json.dumps({**base, f: v}) for f, v in BAD_CHAT_FIELDS + BAD_FIELDS[15:60]]
    frames += [raw.decode("utf-8", "replace") for raw, _ in RAW_BODIES]
    frames += [json.dumps({"type": t}) for t in (None, 1, "dance", ["chat"])]
    frames.append(json.dumps({"type": "cancel", "extra": 1}))
    with connect(url, max_size=None) as ws:
        for frame in frames:
            ws.send(frame)
            reply = json.loads(ws.recv(timeout=30))
            assert reply["type"] == "error" and reply["code"] and reply["message"], (frame, reply)
        ws.send(json.dumps({**base, "temperature": 0}))  # the socket is still usable
        while (reply := json.loads(ws.recv(timeout=30)))["type"] == "token":
            pass
        assert reply["type"] == "done" and reply["usage"]["completion_tokens"] >= 1, reply
    healthy(server, tenant, expected)


@pytest.mark.parametrize(
    "body",
    [
        {"name": 1},
        {"name": ""},
        {"name": "../etc"},
        {"name": "x" * 100},
        {"name": "ok-name", "max_concurrent": 0},
        {"name": "ok-name", "max_concurrent": "1"},
        {"name": "ok-name", "max_concurrent": 1.5},
        {"name": "ok-name", "max_concurrent": True},
        {"name": "ok-name", "tokens_per_minute": -5},
        {"name": "ok-name", "role": "admin"},
        {"name": "ok-name", "weight": 0},
        {"name": "ok-name", "weight": -1},
        {"name": "ok-name", "weight": "2"},
        {"name": "ok-name", "weight": True},
        {"name": "ok-name", "weight": 1e9},
        {"name": "ok-name", "share_prefix_cache": "yes"},
        {"name": "ok-name", "share_prefix_cache": 1},
        {"name": "ok-name", "share_prefix_cache": None},
        [],
        "x",
    ],
)
def test_malformed_admin_tenant_bodies(server, body):
    with server.http(server.admin_token) as c:
        refused(c.post("/admin/tenants", json=body))
        assert "ok-name" not in [t["name"] for t in c.get("/admin/tenants").json()["data"]]


def test_malformed_admin_runner_requests(server):
    with server.http(server.admin_token) as c:
        for body in ({"count": 0}, {"count": 17}, {"count": "2"}, {"count": True}, {"x": 1}):
            refused(c.post("/admin/runners", json=body), param=list(body)[0])
        for count in ("abc", "-1", "0", "99999999999999999999", "1.5"):
            refused(c.delete("/admin/runners", params={"count": count}), param="count")
        assert len(c.get("/admin/runners").json()["runners"]) == 1


def test_malformed_adapter_names(server, tenant, adapter_dirs):
    for name in ("", "../up", "a/b", "x" * 65, server.model_id, ".hidden"):
        refused(server.upload(tenant, name, adapter_dirs["a"]), param="name")


def test_tenant_weights(server):
    with server.http(server.admin_token) as c:
        r = c.post("/admin/tenants", json={"name": "heavy", "weight": 3})
        assert r.status_code == 201 and r.json()["weight"] == 3.0
        for body in ({"weight": 0}, {"weight": "1"}, {"weight": 1e9}, {}, {"weight": 1, "x": 1}):
            refused(c.patch("/admin/tenants/heavy", json=body))
        refused(c.patch("/admin/tenants/nobody", json={"weight": 2}), 404)
        r = c.patch("/admin/tenants/heavy", json={"weight": 0.5})
        assert r.status_code == 200 and r.json()["weight"] == 0.5
        listed = {t["name"]: t["weight"] for t in c.get("/admin/tenants").json()["data"]}
    assert listed["heavy"] == 0.5
