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


def test_entries_are_remembered_forgotten_and_timed_again_when_fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("PUNICA_X_CACHE", str(tmp_path))
    autotune.remember("invariance:a", {"x": 1})
    autotune.remember("invariance:b", {"x": 2})
    autotune.remember("other:c", {"x": 3})
    assert autotune.recall("invariance:a") == {"x": 1}
    assert sorted(autotune.forget("invariance:")) == ["invariance:a", "invariance:b"]
    assert autotune.recall("invariance:a") is None and autotune.recall("other:c") == {"x": 3}
    runs = []

    def candidate(name):
        return lambda: lambda: runs.append(name)

    candidates = {"a": candidate("a"), "b": candidate("b")}
    first = autotune.choose("kind", "key", candidates)
    assert not first.cached and autotune.choose("kind", "key", candidates).cached
    timed = len(runs)
    again = autotune.choose("kind", "key", candidates, fresh=True)
    assert not again.cached and len(runs) > timed


def test_a_round_robin_times_at_least_repeats_rounds_and_more_within_its_budget():
    calls = {"a": 0, "b": 0}

    def run(name):
        def go():
            calls[name] += 1

        return go

    autotune.time_round_robin({n: run(n) for n in calls}, repeats=3, budget_s=0.0)
    assert calls == {"a": 4, "b": 4}  # a warm-up each, then 3 rounds
    calls.update(a=0, b=0)
    autotune.time_round_robin({n: run(n) for n in calls}, repeats=3, budget_s=10.0)
    assert calls["a"] == calls["b"] == autotune.MAX_ROUNDS + 1  # tiny runs: up to the cap
