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
BUCKET = 1.0  # tokens recorded within one second share an entry of the window


class Admission:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._active: dict[int, int] = defaultdict(int)
        self._streams: dict[str, int] = defaultdict(int)
        # per tenant: [second, tokens] entries of the last WINDOW seconds, and their sum (an
        # admission costs O(1) however many tokens a busy minute streamed)
        self._usage: dict[int, deque[list]] = defaultdict(deque)
        self._used: dict[int, int] = defaultdict(int)

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
            second = time.monotonic() // BUCKET * BUCKET
            with self._lock:
                usage = self._usage[tenant.id]
                if usage and usage[-1][0] == second:
                    usage[-1][1] += n
                else:
                    usage.append([second, n])
                self._used[tenant.id] += n

    def _window(self, tenant_id: int) -> tuple[int, float]:
        """(tokens used in the last minute, seconds until the oldest entry leaves it); an
        entry leaves once its second began more than the window ago (so a Retry-After is at
        most the window)."""
        now = time.monotonic()
        usage = self._usage[tenant_id]
        while usage and usage[0][0] < now - WINDOW:
            self._used[tenant_id] -= usage.popleft()[1]
        retry = max(usage[0][0] + WINDOW - now, 0.0) if usage else 1.0
        return self._used[tenant_id], retry
