"""Logprobs and sampling controls through the OpenAI API: completions (logprobs, echo,
scoring with max_tokens 0, streaming), chat (logprobs, top_logprobs), logit_bias and
penalties, against HF + PEFT on the server's tiny model."""

from __future__ import annotations

import json

import openai
import pytest
import torch

PROMPT = [3, 17, 42, 99, 5, 250, 7, 64, 11]


@pytest.fixture(scope="module")
def tenant(server, adapter_dirs):
    key = server.create_tenant("scorer")
    assert server.upload(key, "lp-a", adapter_dirs["a"]).status_code == 201
    return key


@pytest.fixture(scope="module")
def reference(srv_model_dir, adapter_dirs):
    """log_softmax of HF + PEFT (adapter a) logits over a token sequence: [len, V]."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(srv_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dirs["a"]).eval()

    def logp(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logp


def post(server, key, path, body):
    with server.http(key) as c:
        r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_max_tokens_0_scores_the_prompt(server, tenant, reference):
    body = {"model": "lp-a", "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}
    out = post(server, tenant, "/v1/completions", body)
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert out["usage"]["completion_tokens"] == 0
    assert len(lp["tokens"]) == len(PROMPT) and lp["token_logprobs"][0] is None
    assert lp["text_offset"][0] == 0 and lp["top_logprobs"][0] is None
    want = reference(PROMPT)
    for t in range(1, len(PROMPT)):
        assert lp["token_logprobs"][t] == pytest.approx(want[t - 1, PROMPT[t]].item(), abs=1e-3)
        (best,) = lp["top_logprobs"][t].values()
        assert best == pytest.approx(want[t - 1].max().item(), abs=1e-3)


def test_sampled_logprobs_and_their_stream(server, tenant, reference):
    body = {"model": "lp-a", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 3}
    choice = post(server, tenant, "/v1/completions", body)["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == 5  # one entry per token (a byte token may decode to U+FFFD)
    for value, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) <= 3 and value == pytest.approx(max(top.values()))  # greedy
    # the sampled tokens' values against the reference, on prompt + generated ids
    with server.http(tenant) as c:
        ids = c.post(
            "/v1/completions",
            json={**body, "max_tokens": 5, "echo": True, "logprobs": 0},
        ).json()
    assert ids["choices"][0]["text"].endswith(choice["text"])
    streamed = []
    with (
        server.http(tenant) as c,
        c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])["choices"][0]
                if chunk["logprobs"]:
                    streamed.append(chunk["logprobs"])
    assert [t for c in streamed for t in c["tokens"]] == lp["tokens"]
    assert [v for c in streamed for v in c["token_logprobs"]] == lp["token_logprobs"]
    assert [o for c in streamed for o in c["text_offset"]] == lp["text_offset"]


def test_echo_logprobs_match_reference_through_generated_tokens(server, tenant, reference):
    body = {
        "model": "lp-a",
        "prompt": PROMPT,
        "max_tokens": 3,
        "temperature": 0,
        "echo": True,
        "logprobs": 2,
    }
    lp = post(server, tenant, "/v1/completions", body)["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT) + 3
    # recover the generated ids by matching each top token's text (greedy = the top one)
    values = lp["token_logprobs"]
    want = reference(PROMPT)
    for t in range(1, len(PROMPT)):
        assert values[t] == pytest.approx(want[t - 1, PROMPT[t]].item(), abs=1e-3)
    assert values[len(PROMPT)] == pytest.approx(want[-1].max().item(), abs=1e-3)


def test_chat_logprobs_with_the_openai_client(server, tenant):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=tenant, max_retries=0)
    resp = client.chat.completions.create(
        model="lp-a",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 4
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        raw = bytes(c.bytes)
        assert c.token == raw.decode(errors="replace") or c.token == "bytes:" + "".join(
            f"\\x{b:02x}" for b in raw
        )
    plain = client.chat.completions.create(
        model="lp-a", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"echo": "yes"}, "echo"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
        ("/v1/completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"frequency_penalty": "x"}, "frequency_penalty"),
        ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/chat/completions", {"min_p": 1.5}, "min_p"),
    ],
)
def test_bad_logprobs_parameters_name_the_parameter(server, tenant, path, extra, param):
    body = {"model": "lp-a", "max_tokens": 2, **extra}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = PROMPT
    with server.http(tenant) as c:
        r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_logit_bias_and_penalties_reach_the_sampler(server, tenant):
    base = {"model": "lp-a", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    forced = post(server, tenant, "/v1/completions", {**base, "logit_bias": {"42": 100}})
    lp = post(server, tenant, "/v1/completions", {**base, "logit_bias": {"42": 100}, "logprobs": 0})
    assert forced["choices"][0]["text"] == lp["choices"][0]["text"]
    with server.http(tenant) as c:
        r = c.post("/v1/completions", json={**base, "prompt": [42], "max_tokens": 0, "echo": True})
    token_42 = r.json()["choices"][0]["text"]
    assert forced["choices"][0]["text"] == token_42 * 8
    plain = post(server, tenant, "/v1/completions", {**base, "max_tokens": 24})
    penalized = post(
        server, tenant, "/v1/completions", {**base, "max_tokens": 24, "frequency_penalty": 2}
    )
    assert plain["choices"][0]["text"] != penalized["choices"][0]["text"]
