"""How a request moves: recompute it on the target, or copy its KV there (pure policy).

- recompute (Punica sec. 5.3): the target prefills prompt + generated tokens. The client's
  pause is about one prefill of the whole sequence on the target.
- copy (Llumnix's live migration, stop-and-copy form): the source exports the request's KV
  blocks, they travel (a memory copy between thread runners; pickled through Ray's object
  store between processes), the target imports them and computes only the newest token.
  The pause is the export + transfer + import, then one decode step.

Both pauses are modelled as fixed + per-token costs; the constants per backend come from
benchmarks/bench_migration.py on the machine named in each comment, and a runner may carry
its own. A failed runner's KV is gone: failure always recomputes."""

from __future__ import annotations

from dataclasses import dataclass

RECOMPUTE = "recompute"
COPY = "copy"


@dataclass(frozen=True)
class MigrationCosts:
    """Seconds. recompute: prefill_fixed + prefill_per_token * n (+ attention's quadratic
    term, prefill_per_token2 * n^2); copy: copy_fixed + copy_per_byte * kv bytes."""

    prefill_fixed: float
    prefill_per_token: float
    prefill_per_token2: float
    copy_fixed: float
    copy_per_byte: float

    def recompute_seconds(self, num_tokens: int) -> float:
        n = num_tokens
        return self.prefill_fixed + self.prefill_per_token * n + self.prefill_per_token2 * n * n

    def copy_seconds(self, kv_bytes: int) -> float:
        return self.copy_fixed + self.copy_per_byte * kv_bytes


# Fitted by benchmarks/bench_migration.py over 8..2048 tokens (SmolLM2-135M fp32, 46 KB of KV
# per token, 2 threads; AMD EPYC, AVX2, 2 cores, 2026-11-23). Recompute is the target's
# prefill (its n^2 term is CPU attention); a copy between thread runners is two index copies
# in one address space (~1.7 GB/s with the export), between Ray actors a pickle through the
# object store (~150 MB/s). On that machine copying wins from 8 tokens up.
DEFAULT_COSTS = {
    "thread": MigrationCosts(0.047, 9.9e-4, 2.69e-6, 0.0295, 5.9e-10),
    "ray": MigrationCosts(0.054, 1.23e-3, 2.10e-6, 0.0211, 6.6e-9),
}


def choose_mode(
    num_computed_tokens: int, kv_bytes_per_token: int, costs: MigrationCosts, reason: str
) -> str:
    """COPY when its predicted pause is shorter than recomputing, else RECOMPUTE; always
    RECOMPUTE after a failure (nothing to copy from) or with nothing computed yet."""
    if reason == "failure" or num_computed_tokens <= 0:
        return RECOMPUTE
    copy = costs.copy_seconds(num_computed_tokens * kv_bytes_per_token)
    return COPY if copy < costs.recompute_seconds(num_computed_tokens) else RECOMPUTE
