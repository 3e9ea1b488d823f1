"""Adapter pool: named, versioned adapters; device slots budgeted in bytes; LRU host cache.

* register(name, path) validates the adapter completely (nothing is kept when it fails) and
  makes it the current version of `name` atomically. Requests already holding the previous
  version finish on it; that version is dropped when its last request lets go.
* acquire(name) binds a request to the current version. If the weights are not resident,
  a background thread loads them (disk -> host cache -> device) while the batch keeps
  running; the request joins a batch once `ref.ready` is true.
* Device memory is budgeted in bytes of the adapter as served (rank- and target-aware,
  in the pool's dtype: 2 bytes an element in bfloat16, 4 in float32); unreferenced
  resident adapters are evicted least-recently-used first. On CPU the device tier aliases
  the host tensors (no copy), but the budget is still enforced.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from punica_x.config import LoraConfig
from punica_x.lora.adapter import AdapterError, LoraAdapter, LoraTarget, load_peft_adapter
from punica_x.lora.pool_types import (
    AdapterInfo,
    AdapterRef,
    PoolStats,
    UnknownAdapterError,
    _Version,
    next_version_id,
)

__all__ = ["AdapterInfo", "AdapterPool", "AdapterRef", "PoolStats", "UnknownAdapterError"]
PIN_FRACTION = 0.5  # pinned adapters hold at most this share of the device pool


class AdapterPool:
    def __init__(
        self, target: LoraTarget, config: LoraConfig, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.target, self.config, self.device, self.dtype = target, config, device, dtype
        self._lock = threading.RLock()
        self._current: dict[str, _Version] = {}
        self._versions: dict[int, _Version] = {}
        self._host_lru: OrderedDict[int, _Version] = OrderedDict()
        self._pending: list[_Version] = []
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="punica-x-lora")
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.stats = PoolStats()

    # -- registry -----------------------------------------------------------------------
    def register(
        self,
        name: str,
        path: str | Path,
        sha256: str | None = None,
        version: int | None = None,
        pinned: bool | None = None,
    ) -> AdapterInfo:
        """Validate and install `path` as the new current version of `name`. With `sha256`,
        files whose digest differs (see load_peft_adapter) are refused ("sha256_mismatch")
        and the current version stays. version: its id, as the caller numbers them (the
        server: the store's row id, the same on every runner); None: the next of this
        process's own. A version this pool still holds (a request uses it) becomes current
        again as it is (a rollback to it). pinned: pin (True) or unpin (False) the name as
        pin() does, once it is current; None leaves its pin as it was."""
        info = self._register(name, path, sha256, version)
        if pinned is not None:
            self.pin(name, pinned)
        return info

    def _register(
        self, name: str, path: str | Path, sha256: str | None, version: int | None
    ) -> AdapterInfo:
        if not name or len(name) > 256:
            raise AdapterError("bad_name", "adapter names must be 1..256 characters")
        if version is not None:
            held = self._reinstate(name, version)
            if held is not None:
                return held
        adapter = self._parse(Path(path))
        if sha256 is not None and adapter.sha256 != sha256:
            raise AdapterError(
                "sha256_mismatch",
                f"the files at {path} have sha256 {adapter.sha256}, expected {sha256}",
            )
        if adapter.nbytes > self.config.device_bytes:
            raise AdapterError(
                "too_large",
                f"adapter needs {adapter.nbytes} bytes, the device pool "
                f"holds {self.config.device_bytes}",
            )
        info = AdapterInfo(
            name,
            next_version_id() if version is None else version,
            adapter.rank,
            adapter.target_modules,
            adapter.sha256,
            adapter.nbytes,
        )
        version = _Version(info, Path(path), self._pin(adapter))
        with self._lock:
            if info.version in self._versions:  # (registered meanwhile, by another thread)
                raise AdapterError("version_taken", f"version {info.version} is held already")
            self._host_insert(version)
            self._make_current(name, version)
        return info

    def _reinstate(self, name: str, version: int) -> AdapterInfo | None:
        """Make the held `version` of `name` current again (None: not held)."""
        with self._lock:
            held = self._versions.get(version)
            if held is None:
                return None
            if held.info.name != name:
                raise AdapterError(
                    "version_taken", f"version {version} is adapter {held.info.name!r}'s"
                )
            self._make_current(name, held)
            return held.info

    def _make_current(self, name: str, version: _Version) -> None:
        old = self._current.get(name)
        version.current = True
        self._current[name] = version
        self._versions[version.info.version] = version
        if old is not None and old is not version:
            old.current = False
            if old.pinned:  # a pin belongs to the name: its new version is kept instead
                old.pinned = False
                self._keep(version)
            self._maybe_drop(old)

    # -- pinning ------------------------------------------------------------------------
    def pin(self, name: str, pinned: bool = True) -> None:
        """Keep `name`'s current version on the device (loaded now if it is not, never
        evicted) until unpinned; its later versions too. Pinned adapters hold at most
        PIN_FRACTION of the device pool (the rest serves everyone else's): AdapterError
        "pin_limit" beyond it. UnknownAdapterError for a name not registered."""
        with self._lock:
            v = self._current.get(name)
            if v is None:
                raise UnknownAdapterError(name)
            if not pinned:
                v.pinned = False
                if v.refs == 0 and v in self._pending:
                    self._pending.remove(v)
                return
            if v.pinned:
                return
            budget = int(self.config.device_bytes * PIN_FRACTION)
            held = sum(x.info.nbytes for x in self._current.values() if x.pinned)
            if held + v.info.nbytes > budget:
                raise AdapterError(
                    "pin_limit",
                    f"pinned adapters may hold {budget} bytes of the device pool's "
                    f"{self.config.device_bytes}; {held} are pinned and {name!r} needs "
                    f"{v.info.nbytes}: unpin one first",
                )
            self._keep(v)
        self.poll()

    def pinned(self) -> frozenset[str]:
        """The names pinned now."""
        with self._lock:
            return frozenset(n for n, v in self._current.items() if v.pinned)

    def _keep(self, v: _Version) -> None:
        v.pinned = True
        if v.device is None and v.loading is None and v not in self._pending:
            self._pending.append(v)

    def unregister(self, name: str) -> None:
        """New acquires fail at once; running requests finish on the weights they hold."""
        with self._lock:
            version = self._current.pop(name, None)
            if version is None:
                raise UnknownAdapterError(name)
            version.current = version.pinned = False
            if version.refs == 0 and version in self._pending:
                self._pending.remove(version)
            self._maybe_drop(version)

    def info(self, name: str) -> AdapterInfo:
        with self._lock:
            if name not in self._current:
                raise UnknownAdapterError(name)
            return self._current[name].info

    def has_version(self, version: int) -> bool:
        """Whether a version is still held (current, or in use by a request)."""
        with self._lock:
            return version in self._versions

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._current)

    def versions(self) -> frozenset[int]:
        """Every version still held (see has_version)."""
        with self._lock:
            return frozenset(self._versions)

    def resident(self) -> frozenset[str]:
        """Names whose current version is on the device now (a request for them needs no
        load)."""
        with self._lock:
            return frozenset(n for n, v in self._current.items() if v.device is not None)

    def check(self, name: str) -> None:
        """Raise UnknownAdapterError unless `name` is registered."""
        with self._lock:
            if name not in self._current:
                raise UnknownAdapterError(name)

    # -- requests -----------------------------------------------------------------------
    def acquire(self, name: str) -> AdapterRef:
        with self._lock:
            version = self._current.get(name)
            if version is None:
                raise UnknownAdapterError(name)
            version.refs += 1
            version.last_used = time.monotonic()
            if version.device is None and version.loading is None and version not in self._pending:
                self._pending.append(version)
        self.poll()
        return AdapterRef(version)

    def release(self, ref: AdapterRef) -> None:
        with self._lock:
            v = ref._version
            v.refs -= 1
            v.last_used = time.monotonic()
            if v.refs == 0 and v in self._pending:
                self._pending.remove(v)
            self._maybe_drop(v)

    def poll(self) -> None:
        """Finish completed loads and start pending ones that fit (called every step)."""
        with self._lock:
            for v in list(self._versions.values()):
                if v.loading is not None and v.loading.done():
                    self._finish_load(v)
            still_pending = []
            for v in self._pending:
                if (v.refs > 0 or v.pinned) and not self._start_load(v):
                    still_pending.append(v)
            self._pending = still_pending
            self._update_stats()

    def wait_ready(self, ref: AdapterRef, timeout: float = 60.0) -> None:
        """Block until `ref` is resident (offline use and tests)."""
        deadline = time.monotonic() + timeout
        while not ref.ready and ref.error is None:
            self.poll()
            if time.monotonic() > deadline:
                raise TimeoutError(f"adapter {ref.name!r} did not load in {timeout}s")
            time.sleep(0.001)

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)

    # -- internals ----------------------------------------------------------------------
    def _parse(self, path: Path) -> LoraAdapter:
        return load_peft_adapter(path, self.target, self.config.max_lora_rank, self.dtype)

    def _pin(self, adapter: LoraAdapter) -> LoraAdapter:
        if self.device.type != "cuda":
            return adapter
        groups = {g: (a.pin_memory(), b.pin_memory()) for g, (a, b) in adapter.groups.items()}
        return dataclasses.replace(adapter, groups=groups)

    def _start_load(self, v: _Version) -> bool:
        if not self._reserve(v.info.nbytes):
            return False
        self.stats.device_bytes_used += v.info.nbytes
        host = v.host
        if host is not None:
            self._host_lru.move_to_end(v.info.version)
        v.loading = self._loader.submit(self._load, v, host)
        if v.pinned:  # resident as soon as loaded, not at the next step's poll (an idle runner)
            v.loading.add_done_callback(lambda _done, v=v: self._finish_pinned(v))
        return True

    def _finish_pinned(self, v: _Version) -> None:
        with self._lock:
            if v.loading is not None and v.loading.done():
                self._finish_load(v)
                self._update_stats()

    def _load(self, v: _Version, host: LoraAdapter | None) -> LoraAdapter:
        """Runs on the loader thread: disk (if evicted from the host cache) -> device."""
        if host is None:
            host = self._pin(self._parse(v.path))
            if host.sha256 != v.info.sha256:
                raise AdapterError(
                    "changed_on_disk",
                    f"adapter {v.info.name!r} changed on disk "
                    "since it was registered; register it again",
                )
        if self._copy_stream is None:
            return host.to(self.device)
        with torch.cuda.stream(self._copy_stream):
            dev = host.to(self.device, non_blocking=True)
        self._copy_stream.synchronize()
        return dev

    def _finish_load(self, v: _Version) -> None:
        future, v.loading = v.loading, None
        try:
            v.device = future.result()
            self.stats.loads += 1
            if v.host is None:
                v.host = v.device if self.device.type == "cpu" else None
                if v.host is not None:
                    self._host_insert(v)
        except Exception as exc:  # the requests holding v fail with this message
            v.error = f"loading adapter {v.info.name!r} failed: {exc}"
            self.stats.device_bytes_used -= v.info.nbytes
        self._maybe_drop(v)

    def _reserve(self, nbytes: int) -> bool:
        """Evict unreferenced resident adapters (LRU) until nbytes fit; False if they cannot."""
        budget = self.config.device_bytes
        if self.stats.device_bytes_used + nbytes <= budget:
            return True
        idle = sorted(
            (
                v
                for v in self._versions.values()
                if v.device is not None and v.refs == 0 and not v.pinned
            ),
            key=lambda v: v.last_used,
        )
        freeable = sum(v.info.nbytes for v in idle)
        if self.stats.device_bytes_used - freeable + nbytes > budget:
            return False
        for v in idle:
            if self.stats.device_bytes_used + nbytes <= budget:
                break
            self._evict_device(v)
        return True

    def _evict_device(self, v: _Version) -> None:
        v.device = None
        self.stats.device_bytes_used -= v.info.nbytes
        self.stats.evictions += 1

    def _host_insert(self, v: _Version) -> None:
        self._host_lru[v.info.version] = v
        self._host_lru.move_to_end(v.info.version)
        used = sum(x.info.nbytes for x in self._host_lru.values())
        for vid in list(self._host_lru):
            if used <= self.config.host_bytes or vid == v.info.version:
                break
            old = self._host_lru.pop(vid)
            old.host = None
            used -= old.info.nbytes

    def _maybe_drop(self, v: _Version) -> None:
        """Forget a version that is neither current nor used by any request."""
        if v.current or v.refs > 0 or v.loading is not None:
            return
        if v.device is not None:
            v.device = None
            self.stats.device_bytes_used -= v.info.nbytes
        v.host = None
        self._host_lru.pop(v.info.version, None)
        self._versions.pop(v.info.version, None)

    def _update_stats(self) -> None:
        self.stats.host_bytes_used = sum(v.info.nbytes for v in self._host_lru.values())
