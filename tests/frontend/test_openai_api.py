"""The official `openai` client against the server, unchanged; request validation errors;
a request that outgrows the whole KV cache (the tight server)."""

from __future__ import annotations

import openai
import pytest
from live_server import TIGHT_KV_TOKENS


@pytest.fixture(scope="module")
def tenant(server, adapter_dirs):
    key = server.create_tenant("openai-user")
    assert server.upload(key, "style", adapter_dirs["b"]).status_code == 201
    return key


@pytest.fixture(scope="module")
def client(server, tenant):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=tenant, max_retries=0)


def test_models_list(client, server):
    ids = [m.id for m in client.models.list()]
    assert ids == [server.model_id, "style"]


def test_completions_plain_and_streaming_agree(client, server):
    kwargs = dict(
        prompt="hello world", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    for model in (server.model_id, "style"):
        full = client.completions.create(model=model, **kwargs)
        assert full.usage.completion_tokens == 16 and full.usage.prompt_tokens > 0
        assert full.choices[0].finish_reason == "length"
        parts = list(
            client.completions.create(
                model=model, stream=True, stream_options={"include_usage": True}, **kwargs
            )
        )
        assert "".join(p.choices[0].text for p in parts if p.choices) == full.choices[0].text
        assert parts[-1].usage.completion_tokens == 16
    assert (
        client.completions.create(model="style", **kwargs).choices[0].text
        != client.completions.create(model=server.model_id, **kwargs).choices[0].text
    )


def test_chat_completions_stream_with_usage(client):
    messages = [{"role": "user", "content": "say something"}]
    full = client.chat.completions.create(
        model="style", messages=messages, max_tokens=12, temperature=0
    )
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="style",
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[
        0
    ].finish_reason
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_n_and_batched_prompts(client, server):
    kwargs = dict(
        model=server.model_id,
        prompt=["hello", "world"],
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    out = client.completions.create(**kwargs)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 4 * 6
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: reproducible


def test_errors_are_openai_shaped(client, server, tenant):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model_id, prompt="hello " * 5000, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model_id, prompt="hi", max_tokens=100000)
    assert e.value.body["code"] == "max_tokens_too_large"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model_id, prompt="hi", max_tokens=2, n=50)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=server.model_id, messages=[{"role": "wizard", "content": "x"}]
        )
    assert e.value.body["code"] == "invalid_messages"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="pxk-wrong", max_retries=0).models.list()
    with server.http(tenant) as c:
        r = c.post(
            "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = c.post(
            "/v1/completions",
            json={"model": server.model_id, "prompt": "x", "suffix": "!"},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
        r = c.post(
            "/v1/completions", json={"model": server.model_id, "prompt": "x", "temperature": "hot"}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def test_a_request_that_outgrows_the_whole_kv_cache_ends_with_length(tight_server):
    """Its prompt fits the tight server's KV cache, prompt + max_tokens does not even alone:
    it generates until the cache is full and ends with finish_reason length (plain and
    streamed alike), the server logging why; the cache is free again after. A prompt that
    does not fit at all is refused."""
    key = tight_server.create_tenant("outgrown")
    client = openai.OpenAI(
        base_url=tight_server.url + "/v1", api_key=key, max_retries=0, timeout=60
    )
    kwargs = dict(
        model=tight_server.model_id,
        prompt="hello world",
        max_tokens=300,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kwargs)
    assert full.choices[0].finish_reason == "length"
    # as far as the cache goes: the newest token is the one whose KV did not fit
    assert full.usage.prompt_tokens + full.usage.completion_tokens == TIGHT_KV_TOKENS + 1
    parts = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "length"
    assert "".join(p.choices[0].text for p in parts if p.choices) == full.choices[0].text
    assert parts[-1].usage.completion_tokens == full.usage.completion_tokens
    log = tight_server.log.read_text()
    assert f"the whole cache holds {TIGHT_KV_TOKENS} tokens, so it cannot fit even alone" in log
    tight_server.wait_idle()
    assert tight_server.metric("punica_x_kv_blocks_free") == TIGHT_KV_TOKENS // 16
    # a prompt the whole cache cannot hold is refused up front
    with tight_server.http(key) as c:
        body = {"model": tight_server.model_id, "prompt": [5] * TIGHT_KV_TOKENS, "max_tokens": 4}
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["message"].endswith(f"the KV cache holds {TIGHT_KV_TOKENS}")
