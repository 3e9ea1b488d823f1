"""Tenants' adapters through their lifecycle: upload (stored crash-consistently, then
served by every runner), restore after a restart, delete, and the files removed once no
request holds their version.

Adapters are registered on the runners under a tenant-scoped key (``t<tenant id>/<name>``),
so one tenant can never reach another's adapter; lookups answer the same 404 for "not
yours" and "does not exist"."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from frontend.http.errors import ApiError, bad_request, not_found
from frontend.tenancy.durable import StorageFull
from frontend.tenancy.records import AdapterRecord, Tenant
from frontend.tenancy.source_files import SourceFiles
from frontend.tenancy.store import Store
from frontend.tenancy.uploads import CONFIG, WEIGHTS
from punica_x.api import AdapterError, UnknownAdapterError, check_peft_header
from scheduler.cluster import Scheduler

log = logging.getLogger(__name__)
RESTORE_CONCURRENCY = 4  # adapters registered at once after a restart (restore)

# AdapterError codes that mean the stored files are not what the row committed.
UNTRUSTED_FILES = (
    "sha256_mismatch",
    "not_found",
    "missing_file",
    "bad_config",
    "bad_weights",
    "non_finite",
)


def adapter_key(tenant_id: int, name: str) -> str:
    """The runners' name of a tenant's adapter."""
    return f"t{tenant_id}/{name}"


class TenantAdapters:
    """model_id: the base model's id (no adapter may take it)."""

    def __init__(
        self,
        store: Store,
        scheduler: Scheduler,
        model_id: str,
        max_per_tenant: int = 10_000,
        max_pinned: int = 4,
    ) -> None:
        self.store, self.scheduler, self.model_id = store, scheduler, model_id
        self.max_per_tenant = max_per_tenant  # live adapters (Limits.max_adapters_per_tenant)
        self.max_pinned = max_pinned  # pinned ones (Limits.max_pinned_per_tenant)
        self._trash: list[tuple[int, Path]] = []  # (version: row id, files) to delete once unused
        # adapter key -> [its lock, the calls holding or waiting for it] (_lock)
        self._locks: dict[str, list] = {}
        self._arriving: dict[int, set[str]] = {}  # tenant id -> new names being stored (_quota)

    async def restore(self) -> None:
        """Register the stored live adapters with the runners (after a restart), up to
        RESTORE_CONCURRENCY names at a time (each name's versions in the store's order): a
        registration is mostly file reads, hashing and torch ops, which leave the
        interpreter to the others. Files that are missing or do not match the row's sha256
        are never served: the row becomes `broken` and the files are quarantined, each with
        an error line."""
        by_key: dict[str, list[AdapterRecord]] = {}
        for record in self.store.adapters():
            by_key.setdefault(adapter_key(record.tenant_id, record.name), []).append(record)
        gate = asyncio.Semaphore(RESTORE_CONCURRENCY)

        async def restore_key(key: str, records: list[AdapterRecord]) -> None:
            async with gate:
                for record in records:
                    await self._restore_one(key, record)

        await asyncio.gather(*(restore_key(k, r) for k, r in by_key.items()))

    async def _restore_one(self, key: str, record: AdapterRecord) -> None:
        """One stored version registered again (restore): never raises."""
        try:
            await self.scheduler.register_adapter(
                key, record.path, record.sha256, version=record.id
            )
            if record.pinned:
                await self._restore_pin(key, record)
        except AdapterError as exc:
            if exc.code in UNTRUSTED_FILES:
                self.store.set_state(record, "broken")
                moved = (
                    self.store.quarantine(record.path, str(exc)) if record.path.exists() else None
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

    async def _restore_pin(self, key: str, record: AdapterRecord) -> None:
        """Pin a restored adapter again; one the runners cannot pin now (a smaller pool
        than when it was pinned) is served unpinned and stored so, logged."""
        try:
            await self.scheduler.register_adapter(
                key, record.path, record.sha256, version=record.id, pinned=True
            )
        except AdapterError as exc:
            log.warning(
                "adapter %r (tenant %d) is served unpinned: %s", record.name, record.tenant_id, exc
            )
            await asyncio.to_thread(self.store.set_pinned, record, False)

    async def upload(
        self, tenant: Tenant, name: str, files: dict[str, bytes], source: str | None = None
    ) -> AdapterRecord:
        """Store and serve a new version of `name` (source: the lora_path it was loaded from,
        None for an upload). Write order (see store.py): staged files (fsynced) -> a
        `pending` row reserving the version -> rename into the version's own directory -> the
        runners load it, checking the sha256 -> the row committed `live` (older versions
        `deleted` in the same transaction). A kill anywhere leaves nothing that is served
        without a commit; recovery.py cleans the rest at start."""
        key = self._key(tenant, name)
        async with self._lock(key):
            return await self._upload(tenant, name, key, files, source)

    async def load(
        self,
        tenant: Tenant,
        name: str,
        read: Callable[[], SourceFiles],
        replace: bool,
    ) -> AdapterRecord | None:
        """upload() of the files read() returns with their source (blocking I/O, run off the
        event loop), unless the tenant has `name` already and not `replace`: then None and
        nothing is read. Under the name's lock, so loads of one new name racing each other
        make one version."""
        key = self._key(tenant, name)
        async with self._lock(key):
            if not replace and self.store.current_adapter(tenant.id, name) is not None:
                return None
            got = await asyncio.to_thread(read)
            return await self._upload(tenant, name, key, got.files, got.source)

    def _key(self, tenant: Tenant, name: str) -> str:
        if name == self.model_id:
            raise bad_request("invalid_name", "adapter names differ from the base model id", "name")
        return adapter_key(tenant.id, name)

    async def _upload(
        self, tenant: Tenant, name: str, key: str, files: dict[str, bytes], source: str | None
    ) -> AdapterRecord:
        previous = self.store.current_adapter(tenant.id, name)
        with self._quota(tenant, name, previous is None):
            return await self._store_and_serve(tenant, name, key, files, source, previous)

    @contextlib.contextmanager
    def _quota(self, tenant: Tenant, name: str, new: bool):
        """A new name counts against the tenant's max_per_tenant from its check until its
        upload ends: new names uploaded side by side (each under its own name's lock) cannot
        all pass one count (403 adapter_quota_exceeded beyond it)."""
        if not new:
            yield
            return
        arriving = self._arriving.setdefault(tenant.id, set())
        if self.store.count_adapters(tenant.id) + len(arriving) >= self.max_per_tenant:
            raise ApiError(
                403,
                "adapter_quota_exceeded",
                f"your tenant holds {self.max_per_tenant} adapters, this server's limit: "
                "delete one first (a new version of one you hold is not counted)",
                "name",
            )
        arriving.add(name)
        try:
            yield
        finally:
            arriving.discard(name)
            if not arriving:
                del self._arriving[tenant.id]

    async def _store_and_serve(
        self,
        tenant: Tenant,
        name: str,
        key: str,
        files: dict[str, bytes],
        source: str | None,
        previous: AdapterRecord | None,
    ) -> AdapterRecord:
        pending = await self._install(tenant, name, files, source)
        if previous is not None and previous.pinned:  # the pin belongs to the name
            pending = await asyncio.to_thread(self.store.set_pinned, pending, True)
        try:
            await self.scheduler.register_adapter(
                key, pending.path, pending.sha256, version=pending.id
            )
        except BaseException as exc:
            await asyncio.to_thread(self._abort, pending)
            if isinstance(exc, AdapterError):
                raise ApiError(400, exc.code, str(exc)) from None
            raise
        try:
            record, replaced = await _storage(asyncio.to_thread(self.store.commit_adapter, pending))
        except BaseException:
            # The runners serve the new files, but the store could not commit them: put
            # the runners back on what the store says, and undo the reservation.
            await self._serve(key, previous)
            await asyncio.to_thread(self._abort, pending)
            raise
        for old in replaced:
            self._retire(old)
        return record

    async def _install(
        self, tenant: Tenant, name: str, files: dict[str, bytes], source: str | None
    ) -> AdapterRecord:
        """Stage the files, run the checks that need no tensor values on them (off the event
        loop), reserve the version (a `pending` row) and move the files into its directory."""
        staging = await _storage(asyncio.to_thread(self.store.stage, files))
        try:
            info = self.scheduler.info
            # the checks that need no tensor values (no torch here): a runner parses the
            # values once, when it registers the adapter, and refuses NaN / Inf there
            parsed = await asyncio.to_thread(
                check_peft_header, staging, info.lora_target, info.max_lora_rank
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
                    source,
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

    @contextlib.asynccontextmanager
    async def _lock(self, key: str):
        """Uploads, loads and deletes of one adapter name run one at a time, so the runners
        and the store agree on which version is current. A name's lock is forgotten once
        nobody holds or waits for it: names a tenant only tried cost nothing afterwards."""
        entry = self._locks.setdefault(key, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._locks[key]

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
                await self.scheduler.register_adapter(
                    key, record.path, record.sha256, version=record.id
                )
        except Exception:
            log.exception("could not restore the runners' version of %s", key)

    async def pin(self, tenant: Tenant, name: str, pinned: bool) -> AdapterRecord:
        """Pin (or unpin) the current version of `name` on every runner: 404 for a name the
        tenant does not have, 403 pin_quota_exceeded beyond max_pinned_per_tenant, 409
        pin_limit when a runner's device pool holds no more pins (nothing changes then)."""
        key = self._key(tenant, name)
        async with self._lock(key):
            record = self.get(tenant, name)
            if record.pinned == pinned:
                return record
            if pinned and self.store.count_pinned(tenant.id) >= self.max_pinned:
                raise ApiError(
                    403,
                    "pin_quota_exceeded",
                    f"your tenant pins at most {self.max_pinned} adapters on this server: "
                    "unpin one first",
                    "pinned",
                )
            try:
                await self.scheduler.register_adapter(
                    key, record.path, record.sha256, version=record.id, pinned=pinned
                )
            except AdapterError as exc:
                raise ApiError(409, exc.code, str(exc), "pinned") from None
            return await asyncio.to_thread(self.store.set_pinned, record, pinned)

    def list(self, tenant: Tenant) -> list[AdapterRecord]:
        return self.store.adapters(tenant.id)

    def page(self, tenant: Tenant, after: str, limit: int) -> tuple[list[AdapterRecord], bool]:
        """Up to `limit` of the tenant's adapters named after `after`, by name, and whether
        more follow."""
        rows = self.store.adapters_page(tenant.id, after, limit + 1)
        return rows[:limit], len(rows) > limit

    def get(self, tenant: Tenant, name: str) -> AdapterRecord:
        record = self.store.current_adapter(tenant.id, name)
        if record is None:
            raise not_found("adapter_not_found", f"adapter {name!r} does not exist")
        return record

    async def delete(self, tenant: Tenant, name: str) -> AdapterRecord:
        """The row is marked deleted (durably) first, then the runners drop the name, then
        the files go once no request holds them (recovery.py removes them at start if a
        kill came first)."""
        key = adapter_key(tenant.id, name)
        async with self._lock(key):
            record = self.get(tenant, name)
            await _storage(asyncio.to_thread(self.store.mark_deleted, record))
            with contextlib.suppress(UnknownAdapterError):  # a failed start-up restore
                await self.scheduler.unregister_adapter(key)
        self._retire(record)
        return record

    def _retire(self, record: AdapterRecord) -> None:
        """Delete the files once no request holds the version any more."""
        self._trash.append((record.id, record.path))
        self.collect_garbage()

    def collect_garbage(self) -> None:
        """Delete the files of retired versions no runner holds any more (a version's id
        is its store row's, on every runner)."""
        keep = []
        for version, path in self._trash:
            if self.scheduler.has_version(version):
                keep.append((version, path))
            else:
                self.store.remove_files(path)
        self._trash = keep


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
