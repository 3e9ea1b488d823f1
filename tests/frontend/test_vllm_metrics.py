"""vLLM's metric names (frontend/http/vllm_metrics.py) from given stats and adapter counts:
the names gateways read, adapters by the name their tenants call them, each once."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from frontend.http.vllm_metrics import VllmCollector


def _scrape(stats, running, waiting, max_lora=8) -> str:
    registry = CollectorRegistry()
    collector = VllmCollector(lambda: stats, lambda: (running, waiting), "base", lambda: max_lora)
    registry.register(collector)
    return generate_latest(registry).decode()


def test_names_values_and_adapter_lists():
    stats = SimpleNamespace(running=3, waiting=2, kv_blocks_used=30, kv_blocks_free=90)
    running = Counter({"t1/sql": 2, "t2/sql": 1, "t1/chat": 1, "t3/gone": 0})
    text = _scrape(stats, running, Counter({"t4/new": 1}))
    assert 'vllm:num_requests_running{model_name="base"} 3.0' in text
    assert 'vllm:num_requests_waiting{model_name="base"} 2.0' in text
    assert 'vllm:kv_cache_usage_perc{model_name="base"} 0.25' in text
    line = next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
    assert 'running_lora_adapters="chat,sql"' in line and 'waiting_lora_adapters="new"' in line
    assert 'max_lora="8"' in line


def test_no_blocks_and_no_adapters():
    stats = SimpleNamespace(running=0, waiting=0, kv_blocks_used=0, kv_blocks_free=0)
    text = _scrape(stats, Counter(), Counter())
    assert 'vllm:kv_cache_usage_perc{model_name="base"} 0.0' in text
    assert 'running_lora_adapters="",waiting_lora_adapters=""' in text
