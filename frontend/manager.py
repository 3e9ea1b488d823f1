"""One frontend manager behind every adapter (REST, OpenAI API, websocket, admin): tenants,
adapters (tenant-scoped), prompt preparation, admission and generation with metrics.

Adapters are registered on the runners under a tenant-scoped key (``t<tenant id>/<name>``),
so one tenant can never reach another's adapter; lookups answer the same 404 for "not
yours" and "does not exist"."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import torch

from frontend.auth import hash_key, new_api_key
from frontend.config import ServerConfig
from frontend.durable import StorageFull
from frontend.errors import ApiError, bad_request, not_found
from frontend.limits import Admission
from frontend.metrics import Metrics
from frontend.openai.generation import GenerationRequest, ModelFacts, RequestBuilder
from frontend.protocol import TenantCreate
from frontend.store import AdapterRecord, Store, Tenant
from frontend.uploads import CONFIG, WEIGHTS
from punica_x.core import RequestOutput, SamplingParams
from punica_x.errors import ContextTooLong, InvalidRequest
from punica_x.lora.adapter import AdapterError, load_peft_adapter
from punica_x.lora.pool import UnknownAdapterError
from scheduler.cluster import NoRunner, Scheduler
from scheduler.fairness import QUEUE_OVERFLOW

log = logging.getLogger(__name__)

# AdapterError codes that mean the stored files are not what the row committed.
UNTRUSTED_FILES = (
    "sha256_mismatch",
    "not_found",
    "missing_file",
    "bad_config",
    "bad_weights",
    "non_finite",
)


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
        self.model_id = scheduler.info.model.name
        self.max_model_len = scheduler.info.model.max_model_len
        self.serving_dtype = scheduler.info.model.dtype  # adapters are cast to it at load
        self.admission = Admission(config.limits)
        facts = ModelFacts(self.model_id, self.max_model_len, self.tokenizer, config.limits)
        self.requests = RequestBuilder(facts)  # validated bodies -> GenerationRequests
        self.metrics = Metrics(
            scheduler.stats,
            scheduler.runners,
            lambda: scheduler.migrations,
            lambda: scheduler.restarts,
            scheduler.tenant_rows,
        )
        self._trash: list[tuple[int, Path]] = []  # (runner version, files) to delete once unused
        self._versions: dict[int, int] = {}  # store adapter id -> runner version
        self._locks: dict[str, asyncio.Lock] = {}  # adapter key -> its uploads/deletes

    # -- start-up -----------------------------------------------------------------------------
    async def restore_adapters(self) -> None:
        """Register the stored live adapters with the runners (after a restart). Files that
        are missing or do not match the row's sha256 are never served: the row becomes
        `broken` and the files are quarantined, each with an error line."""
        for record in self.store.adapters():
            key = _key(record.tenant_id, record.name)
            try:
                info = await self.scheduler.register_adapter(key, record.path, record.sha256)
                self._versions[record.id] = info.version
            except AdapterError as exc:
                if exc.code in UNTRUSTED_FILES:
                    self.store.set_state(record, "broken")
                    moved = (
                        self.store.quarantine(record.path, str(exc))
                        if record.path.exists()
                        else None
                    )
                    log.error(
                        "stored adapter %r v%d (tenant %d) is not served (%s): %s; files "
                        "quarantined at %s",
                        record.name,
                        record.version,
                        record.tenant_id,
                        exc.code,
                        exc,
                        moved,
                    )
                else:
                    log.error(
                        "stored adapter %r v%d (tenant %d) is not served (%s): %s",
                        record.name,
                        record.version,
                        record.tenant_id,
                        exc.code,
                        exc,
                    )
            except Exception as exc:  # one broken adapter must not keep the server from starting
                log.error(
                    "stored adapter %r (tenant %d) is unusable: %s",
                    record.name,
                    record.tenant_id,
                    exc,
                )

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
        )
        return tenant, key

    def set_tenant_weight(self, name: str, weight: float) -> Tenant:
        tenant = self.store.tenant_by_name(name)
        if tenant is None:
            raise not_found("tenant_not_found", f"tenant {name!r} does not exist")
        self.store.set_tenant_weight(tenant.id, weight)
        return self.store.tenant_by_name(name)

    def revoke_tenant(self, name: str) -> Tenant:
        tenant = self.store.tenant_by_name(name)
        if tenant is None:
            raise not_found("tenant_not_found", f"tenant {name!r} does not exist")
        self.store.revoke_tenant(tenant.id)
        return self.store.tenant_by_name(name)

    # -- adapters -----------------------------------------------------------------------------
    async def upload_adapter(
        self, caller: Caller, name: str, files: dict[str, bytes]
    ) -> AdapterRecord:
        """Store and serve a new version of `name`. Write order (see store.py): staged files
        (fsynced) -> a `pending` row reserving the version -> rename into the version's own
        directory -> the runners load it, checking the sha256 -> the row committed `live`
        (older versions `deleted` in the same transaction). A kill anywhere leaves nothing
        that is served without a commit; recovery.py cleans the rest at start."""
        if name == self.model_id:
            raise bad_request("invalid_name", "adapter names differ from the base model id", "name")
        tenant = caller.tenant
        key = _key(tenant.id, name)
        async with self._lock(key):
            pending = await self._install(tenant, name, files)
            previous = self.store.current_adapter(tenant.id, name)
            try:
                runner_info = await self.scheduler.register_adapter(
                    key, pending.path, pending.sha256
                )
            except BaseException as exc:
                await asyncio.to_thread(self._abort, pending)
                if isinstance(exc, AdapterError):
                    raise ApiError(400, exc.code, str(exc)) from None
                raise
            try:
                record, replaced = await _storage(
                    asyncio.to_thread(self.store.commit_adapter, pending)
                )
            except BaseException:
                # The runners serve the new files, but the store could not commit them: put
                # the runners back on what the store says, and undo the reservation.
                await self._serve(key, previous)
                await asyncio.to_thread(self._abort, pending)
                raise
        self._versions[record.id] = runner_info.version
        for old in replaced:
            self._retire(old)
        return record

    async def _install(self, tenant: Tenant, name: str, files: dict[str, bytes]) -> AdapterRecord:
        """Stage the files, run every runner check on them (off the event loop), reserve the
        version (a `pending` row) and move the files into its directory."""
        staging = await _storage(asyncio.to_thread(self.store.stage, files))
        try:
            info = self.scheduler.info
            parsed = await asyncio.to_thread(
                load_peft_adapter, staging, info.lora_target, info.max_lora_rank, torch.float32
            )
            size = sum(len(files[f]) for f in (CONFIG, WEIGHTS))
            pending = await _storage(
                asyncio.to_thread(
                    self.store.reserve_adapter,
                    tenant.id,
                    name,
                    parsed.rank,
                    parsed.target_modules,
                    parsed.sha256,
                    size,
                    parsed.stored_dtype,
                )
            )
            try:
                await _storage(asyncio.to_thread(self.store.install, staging, pending))
            except BaseException:
                await asyncio.to_thread(self._abort, pending)
                raise
        except AdapterError as exc:
            raise ApiError(400, exc.code, str(exc).replace(str(staging), "<upload>")) from None
        finally:
            await asyncio.to_thread(self.store.remove_files, staging)
        return pending

    def _lock(self, key: str) -> asyncio.Lock:
        """Uploads and deletes of one adapter name run one at a time, so the runners and the
        store agree on which version is current."""
        return self._locks.setdefault(key, asyncio.Lock())

    def _abort(self, pending: AdapterRecord) -> None:
        """Undo a reservation (best effort: recovery finishes it at start if this fails)."""
        try:
            self.store.remove_files(pending.path)
            self.store.set_state(pending, "aborted")
        except Exception:
            log.exception("could not abort pending adapter %r v%d", pending.name, pending.version)

    async def _serve(self, key: str, record: AdapterRecord | None) -> None:
        """Make the runners serve `record` under `key` again (None: nothing)."""
        try:
            if record is None:
                await self.scheduler.unregister_adapter(key)
            else:
                info = await self.scheduler.register_adapter(key, record.path, record.sha256)
                self._versions[record.id] = info.version
        except Exception:
            log.exception("could not restore the runners' version of %s", key)

    def list_adapters(self, caller: Caller) -> list[AdapterRecord]:
        return self.store.adapters(caller.tenant.id)

    def get_adapter(self, caller: Caller, name: str) -> AdapterRecord:
        record = self.store.current_adapter(caller.tenant.id, name)
        if record is None:
            raise not_found("adapter_not_found", f"adapter {name!r} does not exist")
        return record

    async def delete_adapter(self, caller: Caller, name: str) -> AdapterRecord:
        """The row is marked deleted (durably) first, then the runners drop the name, then
        the files go once no request holds them (recovery.py removes them at start if a
        kill came first)."""
        key = _key(caller.tenant.id, name)
        async with self._lock(key):
            record = self.get_adapter(caller, name)
            await _storage(asyncio.to_thread(self.store.mark_deleted, record))
            with contextlib.suppress(UnknownAdapterError):  # a failed start-up restore
                await self.scheduler.unregister_adapter(key)
        self._retire(record)
        return record

    def _retire(self, record: AdapterRecord) -> None:
        """Delete the files once no request holds the version any more."""
        version = self._versions.pop(record.id, None)
        self._trash.append((version if version is not None else -1, record.path))
        self.collect_garbage()

    def collect_garbage(self) -> None:
        keep = []
        for version, path in self._trash:
            if version >= 0 and self.scheduler.has_version(version):
                keep.append((version, path))
            else:
                self.store.remove_files(path)
        self._trash = keep

    def model_ids(self, caller: Caller) -> list[tuple[str, float]]:
        return [(self.model_id, 0.0)] + [(a.name, a.created) for a in self.list_adapters(caller)]

    def resolve_model(self, caller: Caller, model: str) -> str | None:
        """Runner adapter key of `model` (None = the base model); 404 if not the caller's."""
        if model == self.model_id:
            return None
        if self.store.current_adapter(caller.tenant.id, model) is None:
            raise ApiError(404, "model_not_found", f"the model {model!r} does not exist", "model")
        return _key(caller.tenant.id, model)

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
                streams.append(
                    await self.open(caller, gen.model, gen.adapter, choice.prompt, choice.sampling)
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
    ) -> AsyncIterator[RequestOutput]:
        """Start one generation (refusals raise ApiError here) and return its outputs, with
        metrics and token accounting. The caller has admitted the request; closing the
        iterator aborts the generation."""
        try:
            stream = await self.scheduler.open(
                prompt,
                sampling,
                adapter,
                f"req-{uuid.uuid4().hex}",
                tenant=caller.tenant.name,
                weight=caller.tenant.weight,
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
                    now = time.monotonic()
                    (ttft if last == start else itl).observe(now - last)
                    last = now
                    generated.inc(len(out.new_token_ids))
                    self.admission.record_tokens(caller.tenant, len(out.new_token_ids))
                if out.finished:
                    status = out.finish_reason.value if out.finish_reason else "stop"
                yield out
        finally:
            await stream.aclose()
            self.metrics.requests.labels(*labels, status).inc()


async def _storage(work):
    """Await `work`; a full disk becomes the API's 507."""
    try:
        return await work
    except StorageFull as exc:
        log.error("out of disk space: %s", exc)
        raise ApiError(
            507,
            "insufficient_storage",
            "the server is out of disk space; nothing was stored, retry later",
        ) from None


def refusal(exc: InvalidRequest) -> ApiError:
    """A runner's refusal as the API's 400 (context_length_exceeded, invalid_prompt, or
    invalid_value naming the field)."""
    if isinstance(exc, ContextTooLong):
        code = "context_length_exceeded"
    else:
        code = "invalid_prompt" if exc.param in ("prompt", None) else "invalid_value"
    return bad_request(code, str(exc), exc.param)


def _key(tenant_id: int, name: str) -> str:
    return f"t{tenant_id}/{name}"
