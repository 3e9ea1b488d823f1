"""`punica-x serve --policy mlfq`: a runner takes more requests than its batch and picks each
batch by MLFQ priority, so short requests overtake a long one that has used its quantum;
the tokens are FCFS's, and /metrics counts the pauses and swaps."""

from __future__ import annotations

import threading
import time

import openai
import pytest
from live_server import start_server

PROMPTS = {"long": "a long story about", "short-1": "hello world", "short-2": "kv cache in"}
LENGTHS = {"long": 1200, "short-1": 8, "short-2": 8}


@pytest.fixture(scope="module")
def mlfq_server(srv_model_dir, tmp_path_factory):
    srv = start_server(
        srv_model_dir,
        tmp_path_factory.mktemp("mlfq") / "data",
        "--policy",
        "mlfq",
        "--max-batch-size",
        "1",
    )
    yield srv
    srv.stop()


def client(srv, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)


def complete(srv, client: openai.OpenAI, name: str, done: dict) -> None:
    r = client.completions.create(
        model=srv.model_id,
        prompt=PROMPTS[name],
        max_tokens=LENGTHS[name],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    done[name] = (r.choices[0].text, time.monotonic())


def test_short_requests_overtake_a_long_one_with_fcfs_tokens(mlfq_server, server):
    key = mlfq_server.create_tenant("mlfq")
    done: dict = {}
    # clients made before the long request starts (an SSL context takes a while to make on a
    # busy machine): the short requests then arrive while it runs
    clients = {name: client(mlfq_server, key) for name in PROMPTS}
    long = threading.Thread(target=complete, args=(mlfq_server, clients["long"], "long", done))
    long.start()
    time.sleep(0.3)  # the long request runs alone, and uses up its first quanta
    shorts = [
        threading.Thread(target=complete, args=(mlfq_server, clients[name], name, done))
        for name in ("short-1", "short-2")
    ]
    for t in shorts:
        t.start()
    for t in [long, *shorts]:
        t.join(120)
    # batch of one: under FCFS both short requests would wait for all 1200 long tokens
    assert done["short-1"][1] < done["long"][1] and done["short-2"][1] < done["long"][1]
    assert mlfq_server.metric("punica_x_mlfq_pauses_total") >= 1
    with mlfq_server.http(mlfq_server.admin_token) as c:
        text = c.get("/metrics").text
    for direction in ("out", "in"):  # counted (no KV pressure here, so no swaps)
        assert f'punica_x_kv_swaps_total{{direction="{direction}"}} 0.0' in text
        assert f'punica_x_kv_swap_bytes_total{{direction="{direction}"}} 0.0' in text
    fcfs = client(server, server.create_tenant("fcfs-reference"))
    reference: dict = {}
    for name in PROMPTS:
        complete(server, fcfs, name, reference)
        assert done[name][0] == reference[name][0], name
