"""One frontend manager behind every adapter (REST, OpenAI API, websocket, admin): tenants,
adapters (tenant-scoped), prompt preparation, admission and generation with metrics.

Adapters are registered on the runners under a tenant-scoped key (``t<tenant id>/<name>``),
so one tenant can never reach another's adapter; lookups answer the same 404 for "not
yours" and "does not exist"."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
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
from frontend.store import AdapterRecord, Store, Tenant
from frontend.uploads import CONFIG, WEIGHTS
from punica_x.core import MAX_LOGPROBS, RequestOutput, SamplingParams
from punica_x.engine import ContextTooLong
from punica_x.lora.adapter import AdapterError, load_peft_adapter
from punica_x.lora.pool import UnknownAdapterError
from punica_x.structured import JSON_OBJECT, canonical_schema, compile_json_schema
from scheduler.cluster import NoRunner, Scheduler

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
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


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
        self.metrics = Metrics(scheduler.stats, scheduler.runners, lambda: scheduler.migrations)
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
    def create_tenant(
        self, name: str, max_concurrent: int | None = None, tokens_per_minute: int | None = None
    ) -> tuple[Tenant, str]:
        if not isinstance(name, str) or not NAME.match(name):
            raise bad_request("invalid_name", "tenant names are 1-64 of [A-Za-z0-9._-]", "name")
        for value, field in (
            (max_concurrent, "max_concurrent"),
            (tokens_per_minute, "tokens_per_minute"),
        ):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise bad_request("invalid_value", f"{field} must be a positive integer", field)
        if self.store.tenant_by_name(name) is not None:
            raise ApiError(409, "tenant_exists", f"tenant {name!r} already exists")
        key = new_api_key()
        tenant = self.store.create_tenant(
            name, hash_key(key), key[:8], max_concurrent, tokens_per_minute
        )
        return tenant, key

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
        if not NAME.match(name) or name == self.model_id:
            raise bad_request(
                "invalid_name",
                "adapter names are 1-64 of [A-Za-z0-9._-] and differ from the base model id",
                "name",
            )
        tenant = caller.tenant
        key = _key(tenant.id, name)
        async with self._lock(key):
            staging = await _storage(asyncio.to_thread(self.store.stage, files))
            try:
                info = self.scheduler.info
                # Every runner check, before anything reaches a runner (and off the event loop).
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

    def resolve_model(self, caller: Caller, model) -> str | None:
        """Runner adapter key of `model` (None = the base model); 404 if not the caller's."""
        if not isinstance(model, str) or not model:
            raise bad_request(
                "missing_model", "`model` must name the base model or one of your adapters", "model"
            )
        if model == self.model_id:
            return None
        if self.store.current_adapter(caller.tenant.id, model) is None:
            raise ApiError(404, "model_not_found", f"the model {model!r} does not exist", "model")
        return _key(caller.tenant.id, model)

    # -- prompts ------------------------------------------------------------------------------
    def encode_text(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt).input_ids
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in ids):
                raise bad_request(
                    "invalid_prompt", "token ids must be within the vocabulary", "prompt"
                )
        else:
            raise bad_request(
                "invalid_prompt", "prompt must be a string or a list of token ids", "prompt"
            )
        return self._check_length(ids, "prompt")

    def encode_chat(self, messages) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise bad_request("invalid_messages", "`messages` must be a non-empty list", "messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                raise bad_request(
                    "invalid_messages",
                    f"messages[{i}] needs a role of system, user or assistant",
                    "messages",
                )
            clean.append({"role": m["role"], "content": _text_content(m.get("content"), i)})
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(
                "chat_template_missing", "this model has no chat template; use /v1/completions"
            )
        text = self.tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=False)
        return self._check_length(
            self.tokenizer(text, add_special_tokens=False).input_ids, "messages"
        )

    def _check_length(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise bad_request("invalid_prompt", "the prompt is empty", param)
        if len(ids) >= self.max_model_len:
            raise bad_request(
                "context_length_exceeded",
                f"the prompt has {len(ids)} tokens; the model's context is {self.max_model_len}",
                param,
            )
        return ids

    def sampling(
        self,
        body: dict,
        prompt_len: int,
        max_tokens_field: str = "max_tokens",
        api: str = "ws",
    ) -> SamplingParams:
        """api: "completions" (logprobs: 0-20, echo), "chat" (logprobs: bool, top_logprobs:
        0-20) or "ws" (no logprobs). With echo, max_tokens 0 scores the prompt without
        generating: the engine samples one token the caller drops (see openai_api)."""
        logprobs, prompt_logprobs = _logprobs(body, api)
        unsupported_fields = ["suffix", "tools", "functions"]
        if api == "ws":
            unsupported_fields += ["logprobs", "top_logprobs"]
        for unsupported in unsupported_fields:
            if body.get(unsupported) not in (None, False, 0):
                raise bad_request(
                    "unsupported_parameter", f"`{unsupported}` is not supported", unsupported
                )
        logit_bias = self._logit_bias(body.get("logit_bias"))
        for name, lo, hi in (
            ("presence_penalty", -2.0, 2.0),
            ("frequency_penalty", -2.0, 2.0),
            ("min_p", 0.0, 1.0),
        ):
            value = _number(body, name, 0.0)
            if not lo <= value <= hi:
                raise bad_request("invalid_value", f"{name} must be in [{lo:g}, {hi:g}]", name)
        if _number(body, "repetition_penalty", 1.0) <= 0:
            raise bad_request(
                "invalid_value", "repetition_penalty must be > 0", "repetition_penalty"
            )
        room = self.max_model_len - prompt_len
        max_tokens = body.get(max_tokens_field, body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = min(room, self.limits.max_tokens)
        if max_tokens == 0 and api == "completions" and body.get("echo") is True:
            max_tokens = 1  # scoring only: the one sampled token is dropped
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise bad_request(
                "invalid_value", "max_tokens must be a positive integer", max_tokens_field
            )
        if max_tokens > self.limits.max_tokens:
            raise bad_request(
                "max_tokens_too_large",
                f"max_tokens is capped at {self.limits.max_tokens}",
                max_tokens_field,
            )
        if max_tokens > room:
            raise bad_request(
                "context_length_exceeded",
                f"prompt ({prompt_len} tokens) + max_tokens "
                f"({max_tokens}) exceeds the context of {self.max_model_len}",
                max_tokens_field,
            )
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (
            not isinstance(stop, list)
            or len(stop) > 4
            or not all(isinstance(s, str) and s for s in stop)
        ):
            raise bad_request(
                "invalid_value", "stop must be a string or up to 4 non-empty strings", "stop"
            )
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=_number(body, "temperature", 1.0),
                top_p=_number(body, "top_p", 1.0),
                top_k=int(_number(body, "top_k", 0)),
                seed=body.get("seed"),
                stop=tuple(stop or ()),
                ignore_eos=bool(body.get("ignore_eos", False)),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                presence_penalty=_number(body, "presence_penalty", 0.0),
                frequency_penalty=_number(body, "frequency_penalty", 0.0),
                repetition_penalty=_number(body, "repetition_penalty", 1.0),
                min_p=_number(body, "min_p", 0.0),
                logit_bias=logit_bias,
                json_schema=_response_format(body.get("response_format")),
            )
        except (ValueError, TypeError) as exc:
            raise bad_request("invalid_value", str(exc)) from None

    def _logit_bias(self, value) -> tuple[tuple[int, float], ...]:
        """OpenAI's {"token id": bias in [-100, 100]} (at most 300 entries)."""
        if value is None:
            return ()
        vocab = len(self.tokenizer)
        if not isinstance(value, dict) or len(value) > 300:
            raise bad_request(
                "invalid_value", "logit_bias maps up to 300 token ids to biases", "logit_bias"
            )
        out = []
        for key, bias in value.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                token = -1
            if not 0 <= token < vocab:
                raise bad_request(
                    "invalid_value",
                    f"logit_bias key {key!r} is not a token id of this model (0..{vocab - 1})",
                    "logit_bias",
                )
            if (
                isinstance(bias, bool)
                or not isinstance(bias, (int, float))
                or not (-100 <= bias <= 100)
            ):
                raise bad_request(
                    "invalid_value", "logit_bias values must be in [-100, 100]", "logit_bias"
                )
            out.append((token, float(bias)))
        return tuple(out)

    def n_choices(self, body: dict) -> int:
        n = body.get("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= self.limits.max_n:
            raise bad_request(
                "invalid_value", f"n must be an integer in [1, {self.limits.max_n}]", "n"
            )
        return n

    # -- generation ---------------------------------------------------------------------------
    def check_capacity(self) -> None:
        if not self.scheduler.ready():
            raise ApiError(503, "not_ready", "no runner can take work", retry_after=5)
        if self.scheduler.stats().waiting >= self.limits.max_queue:
            raise ApiError(
                503, "overloaded", "the server is at capacity; retry shortly", retry_after=1
            )

    def admit(self, caller: Caller, stream: bool) -> None:
        self.check_capacity()
        self.admission.admit(caller.tenant, caller.key_hash, stream)

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
            stream = await self.scheduler.open(prompt, sampling, adapter, f"req-{uuid.uuid4().hex}")
        except UnknownAdapterError:
            raise ApiError(
                404, "model_not_found", f"the model {model!r} does not exist", "model"
            ) from None
        except ContextTooLong as exc:
            raise bad_request("context_length_exceeded", str(exc)) from None
        except ValueError as exc:
            raise bad_request("invalid_prompt", str(exc)) from None
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


def _response_format(value) -> str | None:
    """OpenAI's response_format -> SamplingParams.json_schema (None for plain text)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request(
                "invalid_value",
                'response_format json_schema needs {"json_schema": {"name", "schema": {...}}}',
                "response_format",
            )
        text = canonical_schema(schema)
        try:
            compile_json_schema(text)
        except ValueError as exc:
            raise bad_request("invalid_value", str(exc), "response_format") from None
        return text
    raise bad_request(
        "invalid_value",
        "response_format.type must be text, json_object or json_schema",
        "response_format",
    )


def _logprobs(body: dict, api: str) -> tuple[int | None, int | None]:
    """(SamplingParams.logprobs, .prompt_logprobs) of an OpenAI body."""
    if api == "completions":
        n = body.get("logprobs")
        if n is not None and (
            not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_LOGPROBS
        ):
            raise bad_request(
                "invalid_value", f"logprobs must be an integer in [0, {MAX_LOGPROBS}]", "logprobs"
            )
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise bad_request("invalid_value", "echo must be a boolean", "echo")
        return n, (n if echo else None)
    if api == "chat":
        wanted = body.get("logprobs", False)
        if wanted is None:
            wanted = False
        if not isinstance(wanted, bool):
            raise bad_request("invalid_value", "logprobs must be a boolean", "logprobs")
        top = body.get("top_logprobs")
        if top is not None:
            if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_LOGPROBS:
                raise bad_request(
                    "invalid_value",
                    f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]",
                    "top_logprobs",
                )
            if not wanted:
                raise bad_request(
                    "invalid_value", "top_logprobs needs logprobs: true", "top_logprobs"
                )
        return ((top or 0) if wanted else None), None
    return None, None


def _key(tenant_id: int, name: str) -> str:
    return f"t{tenant_id}/{name}"


def _number(body: dict, field: str, default: float) -> float:
    value = body.get(field, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request("invalid_value", f"{field} must be a number", field)
    return float(value)


def _text_content(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise bad_request("invalid_messages", f"messages[{i}].content must be text", "messages")
