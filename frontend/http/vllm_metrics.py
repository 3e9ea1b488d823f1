"""vLLM's metric names, for the gateways and orchestrators that read them off a model server's
/metrics to route and to place adapters (the Gateway API Inference Extension's endpoint
picker in llm-d and KServe, AIBrix): the requests running and waiting, the KV cache's use,
and the LoRA adapters in use.

- vllm:num_requests_running / vllm:num_requests_waiting {model_name}: requests placed on
  runners / waiting (at the scheduler and in the runners' batchers), as punica_x_batch_size
  and punica_x_queue_length count them.
- vllm:kv_cache_usage_perc {model_name}: KV blocks in use over all blocks, 0-1, summed over
  the runners.
- vllm:lora_requests_info {max_lora, running_lora_adapters, waiting_lora_adapters}, its value
  the time of the scrape (vLLM's is the time of its last update): the adapters of requests
  placed on runners and of requests waiting at the scheduler, comma-separated, by the name
  their tenants call them (the `model` of their requests; two tenants' adapters of one name
  are one entry); max_lora: the adapters of max_lora_rank on every projection a runner's
  device pool holds (--max-loras when given)."""

from __future__ import annotations

import time

from prometheus_client.core import GaugeMetricFamily


class VllmCollector:
    """stats(): EngineStats summed over the runners; adapter_requests(): (running, waiting)
    counts per adapter key "t<tenant id>/<name>"; model_name: the base model's id;
    max_lora(): the max_lora label (read at the first scrape)."""

    def __init__(self, stats, adapter_requests, model_name: str, max_lora) -> None:
        self._stats, self._adapters = stats, adapter_requests
        self.model_name, self._max_lora = model_name, max_lora
        self.max_lora: int | None = None

    def collect(self):
        s = self._stats()
        labels = ["model_name"]
        for name, doc, value in (
            ("num_requests_running", "requests placed on runners", s.running),
            ("num_requests_waiting", "requests waiting for a batch slot", s.waiting),
            ("kv_cache_usage_perc", "KV cache use, 0-1", _kv_use(s)),
        ):
            g = GaugeMetricFamily(f"vllm:{name}", doc, labels=labels)
            g.add_metric([self.model_name], value)
            yield g
        running, waiting = self._adapters()
        if self.max_lora is None:
            self.max_lora = self._max_lora()
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "LoRA adapters of running and waiting requests (value: the time of the scrape)",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        info.add_metric([str(self.max_lora), _names(running), _names(waiting)], time.time())
        yield info


def _kv_use(s) -> float:
    total = s.kv_blocks_used + s.kv_blocks_free
    return s.kv_blocks_used / total if total else 0.0


def _names(counts) -> str:
    """The adapters counted (keys "t<id>/<name>") by name, each once, sorted."""
    return ",".join(sorted({key.split("/", 1)[-1] for key, n in counts.items() if n > 0}))


def max_lora(config, info) -> int:
    """--max-loras, else the adapters of max_lora_rank on every projection the configured
    device pool holds (at least 1). config: EngineConfig; info: EngineInfo."""
    from punica_x.api import slot_bytes

    if config.lora.max_loras is not None:
        return config.lora.max_loras
    element = 4 if info.model.dtype == "float32" else 2
    each = slot_bytes(info.lora_target, info.max_lora_rank, element)
    return max(1, config.lora.device_bytes // each) if each else 1
