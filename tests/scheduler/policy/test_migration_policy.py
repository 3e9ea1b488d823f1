"""The migration cost model: the shorter predicted pause wins; failures always recompute."""

from scheduler.policy.migration import COPY, DEFAULT_COSTS, RECOMPUTE, MigrationCosts, choose_mode

KV_PER_TOKEN = 46080  # SmolLM2-135M, fp32


def test_copy_wins_where_prefill_is_slow_and_memory_is_fast():
    for backend in ("thread", "ray"):
        for n in (8, 64, 2048):
            assert choose_mode(n, KV_PER_TOKEN, DEFAULT_COSTS[backend], "drain") == COPY


def test_recompute_wins_when_the_copy_is_dear():
    slow_link = MigrationCosts(0.01, 1e-4, 0.0, 0.05, 1e-8)  # fast prefill, 100 MB/s copy
    assert choose_mode(16, KV_PER_TOKEN, slow_link, "drain") == RECOMPUTE
    assert choose_mode(4096, KV_PER_TOKEN, slow_link, "drain") == RECOMPUTE
    cheap_copy = MigrationCosts(0.01, 1e-4, 0.0, 0.001, 1e-11)
    assert choose_mode(16, KV_PER_TOKEN, cheap_copy, "drain") == COPY


def test_failure_and_nothing_computed_recompute():
    costs = DEFAULT_COSTS["thread"]
    assert choose_mode(1000, KV_PER_TOKEN, costs, "failure") == RECOMPUTE
    assert choose_mode(0, KV_PER_TOKEN, costs, "kv_pressure") == RECOMPUTE
