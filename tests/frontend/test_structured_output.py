"""response_format through the API: JSON-schema requests, concurrent with unconstrained ones
on other adapters, all parse and validate; a bad schema is a 400 naming response_format."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def client(server, adapter_dirs):
    key = server.create_tenant("structured")
    for name in ("a", "b"):
        assert server.upload(key, f"so-{name}", adapter_dirs[name]).status_code == 201
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_schema_constrained_requests_validate_next_to_free_ones(client, server):
    def constrained(i):
        r = client.chat.completions.create(
            model=["so-a", "so-b", server.model_id][i % 3],
            messages=[{"role": "user", "content": f"a city, as JSON ({i})"}],
            max_tokens=80,
            temperature=1.0,
            seed=i,
            response_format=FORMAT,
        )
        return r.choices[0]

    def free(i):
        r = client.completions.create(
            model="so-b", prompt=f"free text {i}", max_tokens=16, extra_body={"ignore_eos": True}
        )
        return r.choices[0]

    with ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(constrained, i) for i in range(12)]
        frees = [pool.submit(free, i) for i in range(4)]
        choices = [j.result() for j in jobs]
        assert all(f.result().finish_reason == "length" for f in frees)
    for c in choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_completions_and_json_object_mode(client):
    r = client.completions.create(
        model="so-a",
        prompt="json:",
        max_tokens=80,
        temperature=0,
        extra_body={"response_format": FORMAT},
    )
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = client.chat.completions.create(
        model="so-a",
        messages=[{"role": "user", "content": "any JSON object"}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    assert text.startswith("{")
    if reason == "stop":  # complete: an object; "length": cut short, as OpenAI documents
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        {"type": "json_schema", "json_schema": {"name": "x"}},
        {"type": "yaml"},
        "json",
    ],
)
def test_bad_response_format_names_the_parameter(client, fmt):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="so-a", messages=[{"role": "user", "content": "x"}], response_format=fmt
        )
    assert e.value.body["param"] == "response_format"
