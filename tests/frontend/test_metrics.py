"""/metrics: per tenant and adapter counters and latency histograms, runner gauges, and
preemptions counted under real KV pressure (the tight server)."""

from __future__ import annotations

from live_server import TIGHT_KV_TOKENS


def test_metrics_by_tenant_and_adapter(server, adapter_dirs):
    key = server.create_tenant("measured")
    assert server.upload(key, "m1", adapter_dirs["a"]).status_code == 201
    usage = {"prompt": 0, "completion": 0}
    with server.http(key) as c:
        for stream in (False, True):
            body = {
                "model": "m1",
                "prompt": "hello world",
                "max_tokens": 9,
                "ignore_eos": True,
                "stream": stream,
                "stream_options": {"include_usage": True} if stream else None,
            }
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200
            if not stream:
                u = r.json()["usage"]
                usage["prompt"] += 2 * u["prompt_tokens"]
                usage["completion"] += 2 * u["completion_tokens"]
    labels = {"tenant": "measured", "adapter": "m1"}
    assert server.metric("punica_x_requests_total", **labels, status="length") == 2
    assert server.metric("punica_x_prompt_tokens_total", **labels) == usage["prompt"]
    assert server.metric("punica_x_generation_tokens_total", **labels) == usage["completion"]
    assert server.metric("punica_x_time_to_first_token_seconds_count", **labels) == 2
    assert server.metric("punica_x_inter_token_latency_seconds_count", **labels) == 2 * 8
    assert server.metric("punica_x_adapter_loads_total") >= 1
    for gauge in (
        "punica_x_queue_length",
        "punica_x_batch_size",
        "punica_x_kv_blocks_used",
        "punica_x_kv_blocks_free",
        "punica_x_adapter_device_bytes",
        "punica_x_preemptions_total",
    ):
        assert len(samples(server, gauge)) == 1, gauge  # present (metric() reads 0 if absent)
    assert server.metric("punica_x_kv_blocks_free") > 0


def samples(server, name: str | None = None) -> list:
    """The samples of one scrape (named `name`, or all)."""
    from prometheus_client.parser import text_string_to_metric_families

    with server.http(server.admin_token) as c:
        text = c.get("/metrics").text
    every = [s for f in text_string_to_metric_families(text) for s in f.samples]
    return [s for s in every if name is None or s.name == name]


def test_runner_gauges_while_two_requests_run(server):
    key = server.create_tenant("gauged")
    server.wait_idle()
    free = server.metric("punica_x_kv_blocks_free")
    body = {"model": server.model_id, "prompt": "hi", "max_tokens": 3000, "stream": True}
    body["ignore_eos"] = True
    with (
        server.http(key) as c1,
        server.http(key) as c2,
        c1.stream("POST", "/v1/completions", json=body) as r1,
        c2.stream("POST", "/v1/completions", json=body) as r2,
    ):
        # both are decoding once each has streamed a token; the line iterators stay
        # referenced (dropping one closes its connection, which aborts the request)
        lines = [r1.iter_lines(), r2.iter_lines()]
        for it in lines:
            while not next(it).startswith("data: {"):
                pass
        now = {s.name: s.value for s in samples(server)}  # one scrape: decoding goes on
        assert now["punica_x_batch_size"] == 2 and now["punica_x_queue_length"] == 0
        used = now["punica_x_kv_blocks_used"]
        assert used >= 2 and now["punica_x_kv_blocks_free"] == free - used
    server.wait_idle()
    assert server.metric("punica_x_batch_size") == 0


def test_preemptions_are_counted_and_change_no_token(tight_server):
    """Three requests that each fit the tight server's KV cache alone (~75 tokens of its
    128) but not together: the runner preempts and recomputes, punica_x_preemptions_total
    rises, and every request completes with the greedy text it has when run alone."""
    srv = tight_server
    key = srv.create_tenant("pressed")
    srv.wait_idle()
    assert srv.metric("punica_x_kv_blocks_free") == TIGHT_KV_TOKENS // 16  # as small as meant
    prompts = ["the quick brown fox", "hello world", "paged attention keeps"]
    body = {"model": srv.model_id, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    with srv.http(key) as c:
        alone = []
        for p in prompts:
            r = c.post("/v1/completions", json={**body, "prompt": p})
            assert r.status_code == 200, r.text
            alone.append(r.json()["choices"][0]["text"])
        before = srv.metric("punica_x_preemptions_total")
        r = c.post("/v1/completions", json={**body, "prompt": prompts})  # all three at once
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda ch: ch["index"])
    assert [ch["finish_reason"] for ch in choices] == ["length"] * 3
    assert r.json()["usage"]["completion_tokens"] == 3 * 60
    assert [ch["text"] for ch in choices] == alone
    assert srv.metric("punica_x_preemptions_total") > before


def test_a_joined_output_counts_one_gap_per_token():
    """An output of several tokens (joined steps) adds one inter-token observation per token,
    so the histogram's count is every request's tokens less its first, its sum the time."""
    from frontend.manager import _observe_gaps

    class Hist(list):
        observe = list.append

    ttft, itl = Hist(), Hist()
    _observe_gaps(ttft, itl, 0.5, 3, first=True)  # the first output brought 3 tokens
    _observe_gaps(ttft, itl, 0.3, 3, first=False)
    _observe_gaps(ttft, itl, 0.1, 1, first=False)
    assert ttft == [0.5]
    assert len(itl) == 6  # 7 tokens
    assert max(abs(a - b) for a, b in zip(itl, [0.0, 0.0, 0.1, 0.1, 0.1, 0.1])) < 1e-12
