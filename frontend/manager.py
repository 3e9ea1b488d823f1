"""One frontend manager behind every adapter (REST, OpenAI API, websocket, admin): tenants,
their adapters (tenant_adapters.py), admission and generation with metrics."""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from frontend.config import ServerConfig
from frontend.http.errors import ApiError, bad_request, not_found
from frontend.http.metrics import Metrics
from frontend.http.protocol import TenantCreate, TenantUpdate
from frontend.http.vllm_metrics import VllmCollector, max_lora
from frontend.openai.generation import GenerationRequest, ModelFacts, RequestBuilder
from frontend.openai.logprobs_format import TokenText
from frontend.tenancy.auth import hash_key, new_api_key
from frontend.tenancy.cache_scope import cache_salt
from frontend.tenancy.limits import Admission
from frontend.tenancy.lora_on_request import load_on_request
from frontend.tenancy.records import AdapterRecord, Tenant
from frontend.tenancy.store import Store
from frontend.tenancy.tenant_adapters import TenantAdapters, adapter_key
from frontend.tenancy.tenant_sources import TenantSources
from punica_x.api import (
    ContextTooLong,
    EngineRequest,
    InvalidRequest,
    RequestOutput,
    SamplingParams,
    UnknownAdapterError,
)
from scheduler.cluster import NoRunner, Scheduler
from scheduler.policy.fairness import QUEUE_OVERFLOW

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    tenant: Tenant
    key_hash: str


class FrontendManager:
    def __init__(self, config: ServerConfig, scheduler: Scheduler, store: Store) -> None:
        self.config = config
        self.limits = config.limits
        self.scheduler = scheduler
        self.store = store
        self.tokenizer = scheduler.tokenizer
        # token id -> its text for logprobs, cached across requests (the vocabulary is fixed)
        self.token_text = TokenText(self.tokenizer)
        self.model_id = scheduler.info.model.name
        self.max_model_len = scheduler.info.model.max_model_len
        self.serving_dtype = scheduler.info.model.dtype  # adapters are cast to it at load
        self.family = scheduler.info.model.family  # the base model's family (/v1/models)
        self.weights = {  # what the base model's /v1/models entry says of its weights
            "weight_format": scheduler.info.model.weight_format,
            "weight_bytes": scheduler.info.model.weight_bytes,
        }
        self.admission = Admission(config.limits)
        facts = ModelFacts(self.model_id, self.max_model_len, self.tokenizer, config.limits)
        self.requests = RequestBuilder(facts)  # validated bodies -> GenerationRequests
        self.metrics = Metrics(
            scheduler.stats,
            scheduler.runners,
            lambda: scheduler.migrations,
            lambda: scheduler.restarts,
            scheduler.tenant_rows,
            VllmCollector(
                scheduler.stats,
                scheduler.adapter_requests,
                self.model_id,
                lambda: max_lora(config.engine, scheduler.info),
            ),
        )
        self.adapters = TenantAdapters(
            store,
            scheduler,
            self.model_id,
            config.limits.max_adapters_per_tenant,
            config.limits.max_pinned_per_tenant,
        )
        # where adapters load from by path: --lora-source-root (None: off), tenants' own
        self.sources = TenantSources(config.lora_source_root, config.lora_source_timeout_s)

    # -- start-up -----------------------------------------------------------------------------
    async def restore_adapters(self) -> None:
        await self.adapters.restore()

    # -- tenants ------------------------------------------------------------------------------
    def create_tenant(self, body: TenantCreate) -> tuple[Tenant, str]:
        if self.store.tenant_by_name(body.name) is not None:
            raise ApiError(409, "tenant_exists", f"tenant {body.name!r} already exists")
        key = new_api_key()
        tenant = self.store.create_tenant(
            body.name,
            hash_key(key),
            key[:8],
            body.max_concurrent,
            body.tokens_per_minute,
            body.weight,
            body.share_prefix_cache,
        )
        return tenant, key

    def update_tenant(self, name: str, body: TenantUpdate) -> Tenant:
        """Set what the body gives: the fair-share weight, the prefix-cache sharing, the
        tenant's own adapter source (checked before anything is set)."""
        tenant = self.store.tenant_by_name(name)
        if tenant is None:
            raise not_found("tenant_not_found", f"tenant {name!r} does not exist")
        if body.lora_source is not None:
            source = self.sources.check(body.lora_source)
            self.store.set_tenant_source(tenant.id, source)
        if body.weight is not None:
            self.store.set_tenant_weight(tenant.id, body.weight)
        if body.share_prefix_cache is not None:
            self.store.set_tenant_sharing(tenant.id, body.share_prefix_cache)
        return self.store.tenant_by_name(name)

    def revoke_tenant(self, name: str) -> Tenant:
        tenant = self.store.tenant_by_name(name)
        if tenant is None:
            raise not_found("tenant_not_found", f"tenant {name!r} does not exist")
        self.store.revoke_tenant(tenant.id)
        return self.store.tenant_by_name(name)

    # -- adapters -----------------------------------------------------------------------------
    async def upload_adapter(
        self, caller: Caller, name: str, files: dict[str, bytes], source: str | None = None
    ) -> AdapterRecord:
        return await self.adapters.upload(caller.tenant, name, files, source)

    def list_adapters(self, caller: Caller) -> list[AdapterRecord]:
        return self.adapters.list(caller.tenant)

    def get_adapter(self, caller: Caller, name: str) -> AdapterRecord:
        return self.adapters.get(caller.tenant, name)

    async def pin_adapter(self, caller: Caller, name: str, pinned: bool) -> AdapterRecord:
        return await self.adapters.pin(caller.tenant, name, pinned)

    async def delete_adapter(self, caller: Caller, name: str) -> AdapterRecord:
        return await self.adapters.delete(caller.tenant, name)

    def collect_garbage(self) -> None:
        self.adapters.collect_garbage()

    def model_ids(self, caller: Caller) -> list[tuple[str, float, str]]:
        """(id, created, root) of the base model and the caller's adapters; an adapter's root
        is where it was loaded from (its name for an upload), as vLLM lists a LoRA's path."""
        adapters = [(a.name, a.created, a.source or a.name) for a in self.list_adapters(caller)]
        return [(self.model_id, 0.0, self.model_id)] + adapters

    def source_for(self, caller: Caller):
        """Where the caller's adapters load from by path: its tenant's own source, else the
        server's --lora-source-root (None: loading by path is off for it)."""
        return self.sources.for_tenant(caller.tenant)

    async def load_adapter(
        self, caller: Caller, name: str, lora_path: str, replace: bool
    ) -> AdapterRecord | None:
        """TenantAdapters.load of `lora_path` from the caller's source (source_for, which
        must be on): None when the caller has `name` and not `replace`."""
        source = self.source_for(caller)
        read = functools.partial(source.read, caller.tenant.name, lora_path, self.limits)
        return await self.adapters.load(caller.tenant, name, read, replace)

    async def resolve_model(self, caller: Caller, model: str) -> str | None:
        """Runner adapter key of `model` (None = the base model); 404 if not the caller's.
        With --lora-source-root, an adapter the caller does not have yet is loaded from its
        source folder first when a folder of that name is there
        (frontend/tenancy/lora_on_request.py)."""
        if model == self.model_id:
            return None
        known = self.store.current_adapter(caller.tenant.id, model) is not None
        if not known and (
            self.source_for(caller) is None or not await load_on_request(self, caller, model)
        ):
            raise ApiError(404, "model_not_found", f"the model {model!r} does not exist", "model")
        return adapter_key(caller.tenant.id, model)

    # -- generation ---------------------------------------------------------------------------
    def check_capacity(self, tenant: Tenant) -> None:
        """503 while no runner can take work. When the queue (max_queue) is full, 429 for a
        tenant holding its share of it (the others may still queue, up to QUEUE_OVERFLOW
        times max_queue in all: beyond, or without fair share, 503 for everyone)."""
        if not self.scheduler.accepting():  # a runner is active, or one is being replaced
            raise ApiError(503, "not_ready", "no runner can take work", retry_after=5)
        max_queue = self.limits.max_queue
        if self.scheduler.admits(tenant.name, max_queue):
            return
        if not self.scheduler.fair_share or self.scheduler.queued >= QUEUE_OVERFLOW * max_queue:
            raise ApiError(
                503, "overloaded", "the server is at capacity; retry shortly", retry_after=1
            )
        raise ApiError(
            429,
            "queue_share_exceeded",
            f"the queue of {max_queue} requests is full and tenant {tenant.name!r} holds its "
            "share of it; retry shortly",
            retry_after=1,
        )

    def admit(self, caller: Caller, stream: bool) -> None:
        self.check_capacity(caller.tenant)
        self.admission.admit(caller.tenant, caller.key_hash, stream)

    async def start(self, caller: Caller, gen: GenerationRequest) -> list[AsyncIterator]:
        """Admit `gen` and open one stream per choice (all or none: a refusal closes the
        ones already open and releases the admission). The caller releases the admission
        once the streams are done (release(caller, gen.stream))."""
        self.admit(caller, gen.stream)
        streams: list[AsyncIterator[RequestOutput]] = []
        try:
            for choice in gen.choices:
                salt = cache_salt(caller.tenant, gen.adapter, gen.cache_salt)
                streams.append(
                    await self.open(
                        caller, gen.model, gen.adapter, choice.prompt, choice.sampling, salt
                    )
                )
        except BaseException:
            for s in streams:
                await s.aclose()
            self.release(caller, gen.stream)
            raise
        return streams

    def release(self, caller: Caller, stream: bool) -> None:
        self.admission.release(caller.tenant, caller.key_hash, stream)

    async def open(
        self,
        caller: Caller,
        model: str,
        adapter: str | None,
        prompt: list[int],
        sampling: SamplingParams,
        salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Start one generation (refusals raise ApiError here) and return its outputs, with
        metrics and token accounting. The caller has admitted the request; closing the
        iterator aborts the generation. salt: whose prefix-cached KV it may reuse
        (frontend/tenancy/cache_scope.py; None: the tenant's own)."""
        if salt is None:
            salt = cache_salt(caller.tenant, adapter, None)
        try:
            request = EngineRequest(prompt, sampling, adapter, f"req-{uuid.uuid4().hex}", salt)
            stream = await self.scheduler.open(
                request, tenant=caller.tenant.name, weight=caller.tenant.weight
            )
        except UnknownAdapterError:
            raise ApiError(
                404, "model_not_found", f"the model {model!r} does not exist", "model"
            ) from None
        except InvalidRequest as exc:
            raise refusal(exc) from None
        except ValueError as exc:  # a runner's refusal without a field: still the request's
            log.warning("request refused by the runner: %s", exc)
            raise bad_request("invalid_request", str(exc)) from None
        except NoRunner:
            raise ApiError(503, "not_ready", "no runner can take work", retry_after=5) from None
        return self._observe(caller, model, prompt, stream)

    async def _observe(
        self, caller: Caller, model: str, prompt: list[int], stream
    ) -> AsyncIterator[RequestOutput]:
        labels = (caller.tenant.name, model)
        ttft, itl = self.metrics.ttft.labels(*labels), self.metrics.itl.labels(*labels)
        generated = self.metrics.generated_tokens.labels(*labels)
        self.admission.record_tokens(caller.tenant, len(prompt))
        self.metrics.prompt_tokens.labels(*labels).inc(len(prompt))
        start = last = time.monotonic()
        status = "abort"
        try:
            async for out in stream:
                if out.new_token_ids:
                    if last == start and stream.queue_wait is not None:
                        self.metrics.queue_wait.labels(caller.tenant.name).observe(
                            stream.queue_wait
                        )
                    now, k = time.monotonic(), len(out.new_token_ids)
                    _observe_gaps(ttft, itl, now - last, k, first=last == start)
                    last = now
                    generated.inc(len(out.new_token_ids))
                    self.admission.record_tokens(caller.tenant, len(out.new_token_ids))
                if out.finished:
                    status = out.finish_reason.value if out.finish_reason else "stop"
                yield out
        finally:
            await stream.aclose()
            self.metrics.requests.labels(*labels, status).inc()


def _observe_gaps(ttft, itl, gap: float, tokens: int, first: bool) -> None:
    """One output's `tokens` arriving `gap` s after the last: the first output's time to
    first token, its other tokens 0 apart; a later output's tokens gap / tokens apart. An
    output that joined several steps (a reader that fell behind, --stream-interval) counts
    its tokens in the inter-token histogram as one per token would."""
    if first:
        ttft.observe(gap)
        gap, tokens = 0.0, tokens - 1
    for _ in range(tokens):
        itl.observe(gap / tokens)


def refusal(exc: InvalidRequest) -> ApiError:
    """A runner's refusal as the API's 400 (context_length_exceeded, invalid_prompt, or
    invalid_value naming the field)."""
    if isinstance(exc, ContextTooLong):
        code = "context_length_exceeded"
    else:
        code = "invalid_prompt" if exc.param in ("prompt", None) else "invalid_value"
    return bad_request(code, str(exc), exc.param)
