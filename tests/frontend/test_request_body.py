"""The request layer without a server: JSON bodies refused before any handler, the protocol
models' strict types and ranges, and validation errors mapped onto one OpenAI-shaped 400."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter

from frontend.http.errors import ApiError
from frontend.http.request_body import MAX_DEPTH, depth, parse_json, validate
from frontend.openai.protocol import ChatCompletionRequest, CompletionRequest, WsFrame


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "{",
        "[1]",
        "null",
        '"x"',
        '{"a": NaN}',
        '{"a": -Infinity}',
        '{"a": 1' + "0" * 5000 + "}",
        "[" * 100_000 + "]" * 100_000,
        '{"a": ' + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "}",
        b'{"a": "\xff"}',
    ],
)
def test_bodies_that_are_not_json_objects(raw):
    with pytest.raises(ApiError) as e:
        parse_json(raw)
    assert (e.value.status, e.value.code) == (400, "invalid_json")


def test_depth_counts_nesting_and_stops_early():
    assert depth(1) == 0 and depth({}) == 1 and depth({"a": [1, {"b": []}]}) == 4
    nested: list = []
    for _ in range(10_000):
        nested = [nested]
    assert depth(nested, limit=8) == 9
    assert parse_json('{"a": ' + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1) + "}")


def refusal(model, body, strip_tag=False) -> tuple[str, str | None]:
    with pytest.raises(ApiError) as e:
        validate(model, body, strip_tag)
    assert e.value.status == 400 and e.value.message
    return e.value.code, e.value.param


BASE = {"model": "m", "prompt": "x"}


@pytest.mark.parametrize(
    ("extra", "code", "param"),
    [
        ({"seed": "x"}, "invalid_value", "seed"),
        ({"seed": 1.5}, "invalid_value", "seed"),
        ({"seed": 2**64}, "invalid_value", "seed"),
        ({"temperature": float("nan")}, "invalid_value", "temperature"),
        ({"temperature": float("inf")}, "invalid_value", "temperature"),
        ({"max_tokens": "8"}, "invalid_value", "max_tokens"),
        ({"max_tokens": True}, "invalid_value", "max_tokens"),
        ({"stream": "yes"}, "invalid_value", "stream"),
        ({"stream": True, "stream_options": "x"}, "invalid_value", "stream_options"),
        ({"top_k": -5}, "invalid_value", "top_k"),
        ({"best_of": 2}, "unsupported_parameter", "best_of"),
        ({"suffix": "!"}, "unsupported_parameter", "suffix"),
        ({"bogus": 1}, "unsupported_parameter", "bogus"),
        ({"prompt": [1, True]}, "invalid_prompt", "prompt"),
        ({"prompt": ["a"] * 17}, "invalid_prompt", "prompt"),
        ({"logit_bias": {"x": 1}}, "invalid_value", "logit_bias"),
        ({"min_tokens": 5, "max_tokens": 2}, "invalid_value", "min_tokens"),
        ({"response_format": {"type": "yaml"}}, "invalid_value", "response_format"),
    ],
)
def test_completion_refusals_name_the_field(extra, code, param):
    assert refusal(CompletionRequest, {**BASE, **extra}) == (code, param)


def test_accepted_values_keep_their_meaning():
    body = validate(
        CompletionRequest,
        {**BASE, "seed": -(2**63), "temperature": 1e-40, "suffix": None, "best_of": 1, "n": 1},
    )
    assert body.seed == -(2**63) and body.temperature == 1e-40
    chat = validate(
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
            "max_completion_tokens": 5,
        },
    )
    assert chat.max_tokens == 5 and chat.messages[0].text == "a"


def test_websocket_frames():
    frames = TypeAdapter(WsFrame)
    assert refusal(frames, {"type": "dance"}, strip_tag=True)[0] == "unknown_type"
    assert refusal(frames, {}, strip_tag=True)[0] == "unknown_type"
    chat = {"type": "chat", "model": "m", "messages": [{"role": "user", "content": "a"}]}
    assert refusal(frames, {**chat, "temperature": "x"}, strip_tag=True) == (
        "invalid_value",
        "temperature",
    )
    assert refusal(frames, {**chat, "logprobs": 1}, strip_tag=True) == (
        "unsupported_parameter",
        "logprobs",
    )
    assert type(validate(frames, {"type": "cancel"}, strip_tag=True)).__name__ == "WsCancelFrame"
