"""Admission defaults: one key may drive the server to saturation (no per-key or per-tenant
concurrency cap unless the operator sets one); the caps an operator sets still hold."""

from __future__ import annotations

import pytest

from frontend.config import Limits
from frontend.http.errors import ApiError
from frontend.tenancy.limits import Admission
from frontend.tenancy.records import Tenant


def tenant(max_concurrent: int | None = None) -> Tenant:
    return Tenant(1, "t", 0.0, False, max_concurrent, None)


def test_one_key_is_not_capped_by_default():
    """vLLM's serving benchmark sends everything through one key: 1000 concurrent streams
    are admitted (the bounded queue, not admission, is what says 503)."""
    admission = Admission(Limits())
    t = tenant()
    for _ in range(1000):
        admission.admit(t, "key", stream=True)
    for _ in range(1000):
        admission.release(t, "key", stream=True)


@pytest.mark.parametrize(
    ("limits", "max_concurrent", "stream", "code"),
    [
        (Limits(max_streams_per_key=3), None, True, "too_many_streams"),
        (Limits(tenant_max_concurrent=3), None, False, "too_many_requests"),
        (Limits(), 3, False, "too_many_requests"),  # the tenant row's own cap
    ],
)
def test_operator_caps_hold(limits, max_concurrent, stream, code):
    admission = Admission(limits)
    t = tenant(max_concurrent)
    for _ in range(3):
        admission.admit(t, "key", stream=stream)
    with pytest.raises(ApiError) as e:
        admission.admit(t, "key", stream=stream)
    assert e.value.status == 429 and e.value.code == code
    admission.release(t, "key", stream=stream)
    admission.admit(t, "key", stream=stream)  # a released slot is free again
