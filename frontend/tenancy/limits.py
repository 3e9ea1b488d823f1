"""Admission control on the HTTP side: per-tenant concurrency and tokens-per-minute (429),
per-key concurrent streams (429). A tenant over its limits never slows the others. The
concurrency caps apply only where the operator set them (a tenant's max_concurrent, or
--limit tenant_max_concurrent / max_streams_per_key); by default the bounded queue is the
only limit on how much one key may send."""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque

from frontend.config import Limits
from frontend.http.errors import ApiError
from frontend.tenancy.records import Tenant

WINDOW = 60.0


class Admission:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._active: dict[int, int] = defaultdict(int)
        self._streams: dict[str, int] = defaultdict(int)
        self._usage: dict[int, deque[tuple[float, int]]] = defaultdict(deque)

    def admit(self, tenant: Tenant, key_hash: str, stream: bool) -> None:
        """Take a request slot (and a stream slot) or raise 429 with Retry-After."""
        max_active = tenant.max_concurrent or self.limits.tenant_max_concurrent
        tpm = tenant.tokens_per_minute or self.limits.tenant_tokens_per_minute
        with self._lock:
            used, retry = self._window(tenant.id)
            if used >= tpm:
                raise ApiError(
                    429,
                    "tokens_per_minute_exceeded",
                    f"tenant {tenant.name!r} used its {tpm} tokens per minute",
                    retry_after=retry,
                )
            if max_active is not None and self._active[tenant.id] >= max_active:
                raise ApiError(
                    429,
                    "too_many_requests",
                    f"tenant {tenant.name!r} has {max_active} requests running",
                    retry_after=1,
                )
            max_streams = self.limits.max_streams_per_key
            if stream and max_streams is not None and self._streams[key_hash] >= max_streams:
                raise ApiError(
                    429,
                    "too_many_streams",
                    f"this key has {max_streams} streams open",
                    retry_after=1,
                )
            self._active[tenant.id] += 1
            if stream:
                self._streams[key_hash] += 1

    def release(self, tenant: Tenant, key_hash: str, stream: bool) -> None:
        with self._lock:
            self._active[tenant.id] -= 1
            if stream:
                self._streams[key_hash] -= 1

    def record_tokens(self, tenant: Tenant, n: int) -> None:
        if n:
            with self._lock:
                self._usage[tenant.id].append((time.monotonic(), n))

    def _window(self, tenant_id: int) -> tuple[int, float]:
        """(tokens used in the last minute, seconds until the oldest entry leaves it)."""
        now = time.monotonic()
        usage = self._usage[tenant_id]
        while usage and usage[0][0] < now - WINDOW:
            usage.popleft()
        retry = usage[0][0] + WINDOW - now if usage else 1.0
        return sum(n for _, n in usage), retry
