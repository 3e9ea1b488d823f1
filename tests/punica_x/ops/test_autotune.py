"""punica_x/ops/autotune.py: a cached choice is reused only by a process that would time the
same candidates the same way."""

from __future__ import annotations

from punica_x.ops import autotune, isa


def test_the_fingerprint_changes_with_torchs_isa_limits(monkeypatch):
    """A process held to AVX2 (or a user's ONEDNN_MAX_CPU_ISA) runs oneDNN's and ATen's
    candidates at another speed: it must not reuse choices timed without the limit."""
    for name in isa.LIBRARY_ISA_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    base = autotune.fingerprint()
    assert autotune.fingerprint() == base  # stable within one environment
    for name in isa.LIBRARY_ISA_VARIABLES:
        monkeypatch.setenv(name, "AVX2")
        assert autotune.fingerprint() != base, name
        monkeypatch.delenv(name)
    assert autotune.fingerprint() == base


def test_the_fingerprint_changes_with_the_thread_count(monkeypatch):
    base = autotune.fingerprint()
    monkeypatch.setattr(autotune.torch, "get_num_threads", lambda: 977)
    assert autotune.fingerprint() != base
