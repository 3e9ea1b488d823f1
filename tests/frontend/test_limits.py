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


def test_tokens_per_minute_counts_a_sliding_minute_in_one_entry_a_second(monkeypatch):
    """A busy minute's tokens are kept as one entry a second with their running sum (an
    admission does not add up every output of the last minute); they leave the window a
    minute later, and the 429 says when room comes back."""
    import frontend.tenancy.limits as limits_mod

    clock = [1000.0]
    monkeypatch.setattr(limits_mod.time, "monotonic", lambda: clock[0])
    admission = Admission(Limits(tenant_tokens_per_minute=1000))
    t = tenant()
    for i in range(900):  # 900 outputs of one token within 0.9 s
        clock[0] = 1000.0 + i / 1000
        admission.record_tokens(t, 1)
    assert len(admission._usage[t.id]) == 1 and admission._window(t.id)[0] == 900
    clock[0] = 1010.5
    admission.record_tokens(t, 100)
    with pytest.raises(ApiError) as e:
        admission.admit(t, "key", stream=False)
    assert e.value.code == "tokens_per_minute_exceeded" and 0 < e.value.retry_after <= 50
    clock[0] = 1061.5  # the first second left the window; the 100 tokens are still in it
    admission.admit(t, "key", stream=False)
    assert admission._window(t.id)[0] == 100
    clock[0] = 1072.0
    assert admission._window(t.id)[0] == 0 and not admission._usage[t.id]
