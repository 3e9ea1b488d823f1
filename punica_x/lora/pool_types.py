"""The adapter pool's types (lora/pool.py): what a registered version is, a request's hold on
one, the pool's counters, and the error naming an adapter that is not registered."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from punica_x.lora.adapter import LoraAdapter

_version_ids = itertools.count(1)


def next_version_id() -> int:
    """A version id of this process's own numbering (register without a version)."""
    return next(_version_ids)


_cache_ids = itertools.count(1)  # one per version installed in this process (prefix caching)


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    version: int
    rank: int
    target_modules: tuple[str, ...]
    sha256: str
    nbytes: int


@dataclass(eq=False)
class _Version:
    info: AdapterInfo
    path: Path
    host: LoraAdapter | None
    device: LoraAdapter | None = None
    loading: Future | None = None
    refs: int = 0
    current: bool = True
    pinned: bool = False  # kept on the device while current (AdapterPool.pin)
    error: str | None = None
    last_used: float = field(default_factory=time.monotonic)
    cache_id: int = field(default_factory=lambda: next(_cache_ids))


@dataclass(frozen=True, eq=False)
class AdapterRef:
    """A request's hold on one adapter version (released when the request ends)."""

    _version: _Version

    @property
    def name(self) -> str:
        return self._version.info.name

    @property
    def version(self) -> int:
        return self._version.info.version

    @property
    def cache_id(self) -> str:
        """Names these weights in the KV prefix cache (punica_x/kv/prefix.py): unique among
        every version ever installed in this process, so a re-upload under a reused version
        id, or another adapter's, never finds blocks computed with other weights; a rollback
        to a version still held keeps its id (the same weights)."""
        return f"{self._version.cache_id}:{self._version.info.sha256}"

    @property
    def ready(self) -> bool:
        return self._version.device is not None

    @property
    def error(self) -> str | None:
        return self._version.error

    @property
    def weights(self) -> LoraAdapter:
        w = self._version.device
        if w is None:
            raise RuntimeError(f"adapter {self.name!r} is not resident")
        return w


@dataclass
class PoolStats:
    loads: int = 0
    evictions: int = 0
    device_bytes_used: int = 0
    host_bytes_used: int = 0


class UnknownAdapterError(KeyError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"adapter {self.name!r} is not registered"
