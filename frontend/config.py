"""Server configuration: the engine config of the runner inside, plus HTTP-side limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from punica_x.api import EngineConfig

MiB = 1 << 20
RUNNER_BACKENDS = ("thread", "process", "ray")


@dataclass(frozen=True)
class Limits:
    """Caps applied before a request reaches the scheduler."""

    max_upload_bytes: int = 512 * MiB  # request body of POST /v1/adapters
    max_config_bytes: int = 1 * MiB  # adapter_config.json (413 config_too_large beyond)
    max_archive_entries: int = 8
    max_unpacked_bytes: int = 1024 * MiB  # sum of an archive's files once decompressed
    max_tokens: int = 4096  # cap on max_tokens of one request
    max_n: int = 4  # completions per request
    # Concurrency caps are operator limits, off by default (None): one key may drive the
    # server to saturation, as with vLLM, LoRAX or TGI; what the runners cannot take waits
    # in the bounded queue (max_queue) and only beyond it gets 503 + Retry-After.
    max_streams_per_key: int | None = None  # concurrent streams (SSE + websocket) per API key
    max_queue: int = 256  # requests waiting on the runners; beyond: 503 + Retry-After
    tenant_max_concurrent: int | None = None  # per tenant (a tenant row may set its own)
    tenant_tokens_per_minute: int = 1_000_000  # prompt + generated tokens, sliding minute
    max_ws_frame_bytes: int = 1 * MiB  # larger websocket frames close the socket with 1009
    max_body_bytes: int = 8 * MiB  # JSON bodies of the OpenAI routes
    max_runners: int = 32  # POST /admin/runners refuses (409) to start more than this in all
    # live adapters one tenant may hold (uploaded or loaded); a new name beyond: 403
    max_adapters_per_tenant: int = 10_000
    # adapters one tenant may pin on the runners' devices (PATCH /v1/adapters/{name}): beyond, 403
    max_pinned_per_tenant: int = 4


def distkv_off(engine: EngineConfig) -> str | None:
    """Why DistKV cannot run beside the engine's other choices (docs/distkv.md), or None."""
    if engine.attention_workers:
        return "the attention workers (--attention-workers) hold the KV and lend none"
    if engine.batch.policy != "fcfs":
        return "the mlfq policy's KV swapping does not move borrowed blocks"
    return None


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Path("data")
    engine: EngineConfig = field(default_factory=EngineConfig)
    limits: Limits = field(default_factory=Limits)
    runners: int = 1  # runners started with the server (admin scale adds and removes them)
    runner_backend: str = "thread"
    # thread runners' devices, runner-i on devices[i % len] (scheduler/runners/devices.py); () : the
    # engine config's own device for all
    devices: tuple[str, ...] = ()
    ray_address: str | None = None  # join this Ray cluster ("auto": the local one); else start one
    autoscale: str | None = None  # "MIN:MAX": act on the scaling advice (scheduler/autoscale.py)
    idle_after_s: float = 60.0  # a runner idle this long (others with room) is advised away
    # DistKV: a prompt too long for one runner borrows KV blocks on the others (thread runners)
    distkv: bool = True
    # tenants share the runners by weighted service while requests wait
    # (scheduler/policy/fairness.py)
    fair_share: bool = True
    restart_runners: bool = True  # a dead runner is replaced (scheduler RestartPolicy)
    # POST /v1/load_lora_adapter reads tenant T's adapters from <this>/T/: a directory, or an
    # object store's URI (s3://BUCKET/PREFIX); None: the route is off.
    # frontend/tenancy/lora_sources.py, object_sources.py
    lora_source_root: Path | str | None = None
    # an object store that does not answer (connect, each read) within this is 504
    lora_source_timeout_s: float = 15.0

    def __post_init__(self) -> None:
        if self.runners < 1:
            raise ValueError(f"runners must be >= 1, got {self.runners}")
        if self.distkv and self.runner_backend == "thread" and len(set(self.devices)) > 1:
            raise ValueError(
                "DistKV between thread runners on different devices is not supported "
                "(remote attention results are not copied across GPUs): add --no-distkv"
            )
        if self.distkv and distkv_off(self.engine) is not None:
            raise ValueError(f"DistKV cannot run here: {distkv_off(self.engine)}: distkv=False")
        if self.autoscale is not None:
            from scheduler.autoscale import AutoscaleConfig

            AutoscaleConfig.parse(self.autoscale)  # ValueError naming the problem
        if self.runner_backend not in RUNNER_BACKENDS:
            raise ValueError(
                f"runner_backend must be one of {RUNNER_BACKENDS}, got {self.runner_backend!r}"
            )
