"""WS /v1/chat/ws: auth before accept, streamed token frames, turns, cancel, bad frames,
frames just under the cap served and just over it closed with 1009 (the default cap and
`--limit max_ws_frame_bytes`), and disconnects (the KV cache returns to its baseline)."""

from __future__ import annotations

import json

import pytest
from live_server import TIGHT_WS_FRAME_BYTES
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect


@pytest.fixture(scope="module")
def key(server):
    return server.create_tenant("ws-user")


def ws_url(server, token=None):
    url = server.url.replace("http://", "ws://") + "/v1/chat/ws"
    return f"{url}?token={token}" if token else url


def chat(ws, server, content="hello", max_tokens=8, model=None):
    ws.send(
        json.dumps(
            {
                "type": "chat",
                "model": model or server.model_id,
                "max_tokens": max_tokens,
                "temperature": 0,
                "messages": [{"role": "user", "content": content}],
            }
        )
    )


def read_reply(ws):
    frames = []
    while True:
        frame = json.loads(ws.recv(timeout=30))
        frames.append(frame)
        if frame["type"] in ("done", "error"):
            return frames


def test_auth_happens_before_accept(server, key):
    for url, headers in (
        (ws_url(server), None),
        (ws_url(server, "pxk-wrong"), None),
        (ws_url(server), {"Authorization": "Bearer pxk-wrong"}),
    ):
        with pytest.raises(InvalidStatus) as e, connect(url, additional_headers=headers):
            pass
        assert e.value.response.status_code == 403
    with connect(ws_url(server), additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        chat(ws, server)
        assert read_reply(ws)[-1]["type"] == "done"


def test_tokens_stream_then_done_over_several_turns(server, key):
    with connect(ws_url(server, key)) as ws:
        for turn in range(2):
            chat(ws, server, content=f"turn {turn}", max_tokens=40)
            frames = read_reply(ws)
            assert {f["type"] for f in frames[:-1]} == {"token"} and len(frames) > 2
            done = frames[-1]
            assert done["type"] == "done" and done["finish_reason"] in ("length", "stop")
            assert done["usage"]["completion_tokens"] <= 40 and done["usage"]["prompt_tokens"] > 0


def test_cancel_stops_generation(server, key):
    with connect(ws_url(server, key)) as ws:
        chat(ws, server, max_tokens=3000)
        assert json.loads(ws.recv(timeout=30))["type"] == "token"
        ws.send(json.dumps({"type": "cancel"}))
        done = read_reply(ws)[-1]
        assert done == {**done, "type": "done", "finish_reason": "cancelled"}
        assert done["usage"]["completion_tokens"] < 3000
        chat(ws, server)  # still usable
        assert read_reply(ws)[-1]["type"] == "done"
    server.wait_idle()


def test_bad_frames_get_errors_and_the_socket_stays_usable(server, key):
    with connect(ws_url(server, key)) as ws:
        for raw, code in (
            ("not json", "invalid_frame"),
            ("[1, 2]", "invalid_frame"),
            ('{"type": "dance"}', "unknown_type"),
        ):
            ws.send(raw)
            frame = json.loads(ws.recv(timeout=10))
            assert frame["type"] == "error" and frame["code"] == code
        chat(ws, server, model="missing-adapter")
        error = read_reply(ws)[-1]
        assert error["type"] == "error" and error["code"] == "model_not_found"
        chat(ws, server)
        assert read_reply(ws)[-1]["type"] == "done"


def padded_chat(server, size: int) -> str:
    """A chat frame of exactly `size` bytes (JSON whitespace pads it: an unknown field would
    be refused)."""
    frame = {
        "type": "chat",
        "model": server.model_id,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "hello"}],
    }
    raw = json.dumps(frame)
    raw = raw[:-1] + " " * (size - len(raw)) + "}"
    assert len(raw.encode()) == size
    return raw


def assert_cap(server, key, cap: int) -> None:
    """A frame a few bytes under `cap` is read and answered (a whole reply) on a socket that
    stays usable; one a few bytes over closes it with 1009."""
    with connect(ws_url(server, key), max_size=None) as ws:
        ws.send(padded_chat(server, cap - 16))
        frames = read_reply(ws)
        assert frames[-1]["type"] == "done", frames[-1]
        assert frames[-1]["usage"]["completion_tokens"] == 4
        chat(ws, server)
        assert read_reply(ws)[-1]["type"] == "done"
        ws.send(padded_chat(server, cap + 16))
        with pytest.raises(ConnectionClosed) as e:
            ws.recv(timeout=10)
        assert e.value.rcvd.code == 1009


def test_frames_over_1_mib_close_with_1009_and_under_it_are_served(server, key):
    assert_cap(server, key, 1 << 20)  # the default (docs/api.md: frames over 1 MiB close)
    with connect(ws_url(server, key), max_size=None) as ws:
        ws.send("x" * (2 << 20))
        with pytest.raises(ConnectionClosed) as e:
            ws.recv(timeout=10)
        assert e.value.rcvd.code == 1009


def test_limit_max_ws_frame_bytes_is_honoured(tight_server):
    """`punica-x serve --limit max_ws_frame_bytes=4096` (see tight_server)."""
    key = tight_server.create_tenant("ws-capped")
    assert_cap(tight_server, key, TIGHT_WS_FRAME_BYTES)


def test_disconnect_aborts_and_frees_kv(server, key):
    server.wait_idle()
    before = server.metric("punica_x_requests_total", tenant="ws-user", status="abort")
    aborted = server.metric("punica_x_engine_aborts_total")
    ws = connect(ws_url(server, key))
    chat(ws, server, max_tokens=3000)
    assert json.loads(ws.recv(timeout=30))["type"] == "token"
    assert server.metric("punica_x_kv_blocks_used") > 0
    assert server.metric("punica_x_batch_size") == 1
    ws.close()
    server.wait_idle(timeout=10)  # no request running, no KV block used, nothing queued
    # the engine itself aborted it (a reply run to its end would count no engine abort)
    assert server.metric("punica_x_engine_aborts_total") == aborted + 1
    assert server.metric("punica_x_requests_total", tenant="ws-user", status="abort") == before + 1


def test_query_token_is_never_logged(server, key):
    with connect(ws_url(server, key)) as ws:
        chat(ws, server)
        read_reply(ws)
    log = server.log.read_text()
    assert "/v1/chat/ws" in log  # the access line is there, without its query string
    assert key not in log


def test_response_format_in_the_chat_frame(server, key):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    with connect(ws_url(server, key)) as ws:
        ws.send(
            json.dumps(
                {
                    "type": "chat",
                    "model": server.model_id,
                    "max_tokens": 40,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": "a number"}],
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "n", "schema": schema},
                    },
                }
            )
        )
        frames = read_reply(ws)
    assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "stop"
    text = "".join(f["text"] for f in frames if f["type"] == "token")
    jsonschema.validate(json.loads(text), schema)
