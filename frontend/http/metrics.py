"""Prometheus metrics: per tenant and adapter request/token counters and latency histograms;
runner gauges (queue, batch, KV blocks, adapter loads) and each tenant's fair-share state,
read at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
LABELS = ("tenant", "adapter")

# per-runner gauges: metric name -> (help, key of the row GET /admin/runners lists)
PER_RUNNER = {
    "runner_running": ("requests running on a runner", "running"),
    "runner_waiting": ("requests waiting in a runner's batcher", "waiting"),
    "runner_kv_blocks_used": ("KV blocks in use on a runner", "kv_blocks_used"),
    "runner_kv_blocks_free": ("free KV blocks on a runner", "kv_blocks_free"),
    "runner_kv_blocks_cached": (
        "KV blocks a runner keeps only for their content (prefix caching; evictable)",
        "kv_blocks_cached",
    ),
    "kv_blocks_lent": ("KV blocks a runner lends to peers (DistKV)", "kv_blocks_lent"),
    "kv_blocks_borrowed": (
        "KV blocks a runner's requests hold on peers (DistKV)",
        "kv_blocks_borrowed",
    ),
}


class RunnerCollector:
    """Cluster totals (unlabelled, as before there were many runners), then per runner
    (label `runner`), moves between runners by reason and mode, and dead runners replaced
    (`restarts`: a callable returning the scheduler's count)."""

    def __init__(self, stats, runners=None, migrations=None, restarts=None) -> None:
        self._stats = stats
        self._runners = runners
        self._migrations = migrations
        self._restarts = restarts

    def collect(self):
        s = self._stats()
        yield from _totals(s)
        if self._runners is not None:
            yield from _per_runner(self._runners())
        if self._migrations is not None:
            c = CounterMetricFamily(
                "punica_x_migrations", "requests moved between runners", labels=["reason", "mode"]
            )
            for (reason, mode), n in sorted(self._migrations().items()):
                c.add_metric([reason, mode], n)
            yield c
        if self._restarts is not None:
            yield CounterMetricFamily(
                "punica_x_runner_restarts",
                "dead runners replaced by a new runner (a step raised, a thread or process died)",
                value=self._restarts(),
            )


def _totals(s):
    gauges = {
        "queue_length": ("requests waiting for a batch slot", s.waiting),
        "batch_size": ("requests in the running batch", s.running),
        "kv_blocks_used": ("KV cache blocks in use", s.kv_blocks_used),
        "kv_blocks_free": ("free KV cache blocks", s.kv_blocks_free),
        "adapter_device_bytes": ("adapter bytes resident on the device", s.adapter_device_bytes),
        "cuda_graphs": ("decode CUDA graphs captured", s.cuda_graphs),
    }
    for name, (doc, value) in gauges.items():
        yield GaugeMetricFamily(f"punica_x_{name}", doc, value=value)
    counters = {
        "adapter_loads": ("adapter loads onto the device", s.adapter_loads),
        "adapter_evictions": ("adapters evicted from the device", s.adapter_evictions),
        "preemptions": ("requests preempted for KV memory (recomputed)", s.preemptions),
        "mlfq_pauses": ("running requests paused for higher-priority ones (MLFQ)", s.pauses),
        "engine_aborts": ("requests aborted in a runner (a client left, a cancel)", s.aborts),
        "attention_worker_losses": (
            "attention workers lost and replaced (Lamina; their requests recomputed)",
            s.attention_worker_losses,
        ),
        "prefix_cache_queries": (
            "prompt tokens looked up in the prefix cache",
            s.prefix_cache_queries,
        ),
        "prefix_cache_hits": ("prompt tokens found in the prefix cache", s.prefix_cache_hits),
        "cuda_graph_steps": ("decode steps replayed from a CUDA graph", s.cuda_graph_steps),
        "eager_decode_steps": (
            "decode-only steps run eagerly on a runner with CUDA graphs (a shape or feature "
            "the graphs do not cover)",
            s.eager_decode_steps,
        ),
    }
    for name, (doc, value) in counters.items():
        yield CounterMetricFamily(f"punica_x_{name}", doc, value=value)
    for name, doc, out, back in (
        ("kv_swaps", "KV swaps to host memory and back (MLFQ)", s.swaps_out, s.swaps_in),
        ("kv_swap_bytes", "KV bytes swapped (MLFQ)", s.swap_bytes_out, s.swap_bytes_in),
    ):
        c = CounterMetricFamily(f"punica_x_{name}", doc, labels=["direction"])
        c.add_metric(["out"], out)
        c.add_metric(["in"], back)
        yield c


def _per_runner(rows: list):
    for name, (doc, key) in PER_RUNNER.items():
        g = GaugeMetricFamily(f"punica_x_{name}", doc, labels=["runner"])
        for row in rows:
            g.add_metric([row.id], getattr(row, key))
        yield g
    remote = SummaryMetricFamily(
        "punica_x_remote_attention_seconds",
        "round trips of the micro-attention calls a runner's requests sent to the "
        "runners holding their borrowed KV blocks (DistKV)",
        labels=["runner"],
    )
    for row in rows:
        remote.add_metric(
            [row.id],
            count_value=row.remote_attention_calls,
            sum_value=row.remote_attention_seconds,
        )
    yield remote
    yield from _prefix_cache(rows)
    up = GaugeMetricFamily(
        "punica_x_runner_active", "1 if the runner takes work", labels=["runner", "state"]
    )
    for row in rows:
        up.add_metric([row.id, row.state], 1.0 if row.state == "active" else 0.0)
    yield up


def _prefix_cache(rows: list):
    """Prefix caching per runner and adapter (the runners' adapter key, "" for the base
    model): prompt tokens of admitted requests looked up, and found cached."""
    for name, doc, i in (
        ("prefix_cache_queries_tokens", "tokens looked up in the prefix cache", 1),
        ("prefix_cache_hits_tokens", "tokens found in the prefix cache (not prefilled)", 2),
    ):
        c = CounterMetricFamily(f"punica_x_{name}", doc, labels=["runner", "adapter"])
        for row in rows:
            for entry in row.prefix_cache:
                c.add_metric([row.id, entry[0]], entry[i])
        yield c


class TenantCollector:
    """Each tenant's fair-share state (scheduler/policy/fairness.py): its virtual token counter,
    the tokens served to it, its requests waiting at the scheduler and placed on runners.
    rows(): TenantRow objects."""

    def __init__(self, rows) -> None:
        self._rows = rows

    def collect(self):
        rows = [r for r in self._rows() if r.tenant]
        families = (
            (GaugeMetricFamily, "tenant_virtual_tokens", "service (VTC)", "virtual_tokens"),
            (CounterMetricFamily, "tenant_served_tokens", "prompt + generated", "served_tokens"),
            (GaugeMetricFamily, "tenant_waiting", "requests waiting at the scheduler", "waiting"),
            (GaugeMetricFamily, "tenant_running", "requests placed on runners", "running"),
            (GaugeMetricFamily, "tenant_weight", "fair-share weight", "weight"),
        )
        for kind, name, doc, field in families:
            family = kind(f"punica_x_{name}", doc, labels=["tenant"])
            for row in rows:
                family.add_metric([row.tenant], getattr(row, field))
            yield family


class Metrics:
    def __init__(
        self, stats, runners=None, migrations=None, restarts=None, tenants=None, vllm=None
    ):
        """stats, runners, migrations, restarts: RunnerCollector's callables; tenants: a
        callable returning TenantRows (None: no tenant metrics); vllm: a VllmCollector
        (vllm_metrics.py: vLLM's names, for gateways), or None."""
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "punica_x_requests", "requests by outcome", LABELS + ("status",), registry=r
        )
        self.prompt_tokens = Counter("punica_x_prompt_tokens", "prompt tokens", LABELS, registry=r)
        self.generated_tokens = Counter(
            "punica_x_generation_tokens", "generated tokens", LABELS, registry=r
        )
        self.ttft = self._histogram("time_to_first_token_seconds", "time to first token")
        self.itl = self._histogram("inter_token_latency_seconds", "time between streamed tokens")
        self.queue_wait = Histogram(
            "punica_x_queue_wait_seconds",
            "time a request waited at the scheduler before a runner took it",
            ("tenant",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        r.register(RunnerCollector(stats, runners, migrations, restarts))
        if tenants is not None:
            r.register(TenantCollector(tenants))
        if vllm is not None:
            r.register(vllm)

    def _histogram(self, name: str, doc: str) -> Histogram:
        return Histogram(
            f"punica_x_{name}", doc, LABELS, buckets=LATENCY_BUCKETS, registry=self.registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
