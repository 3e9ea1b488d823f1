"""/metrics: per tenant and adapter counters and latency histograms, runner gauges."""

from __future__ import annotations


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
    for gauge in ("punica_x_queue_length", "punica_x_batch_size", "punica_x_kv_blocks_used"):
        assert server.metric(gauge) >= 0
    assert server.metric("punica_x_kv_blocks_free") > 0
