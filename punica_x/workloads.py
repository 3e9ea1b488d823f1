"""Adapter-popularity workloads (Punica sec. 7): which adapter each request of a batch uses.

* distinct:  every request its own adapter
* uniform:   ceil(sqrt(n)) adapters, requests spread evenly over them
* zipf-1.5:  adapters drawn from a Zipf(alpha=1.5) popularity over n candidates
* identical: one adapter for all
* skewed:    one hot adapter takes half the requests, the rest are distinct (a long tail)
"""

from __future__ import annotations

import math
import random

POPULARITIES = ("distinct", "uniform", "zipf-1.5", "identical", "skewed")


def assign_adapters(popularity: str, n: int, rng: random.Random | None = None) -> list[int]:
    """Adapter index of each of ``n`` requests, in arrival order (not grouped)."""
    rng = rng or random.Random()
    if popularity == "distinct":
        return list(range(n))
    if popularity == "uniform":
        k = math.ceil(math.sqrt(n))
        return [i % k for i in range(n)]
    if popularity.startswith("zipf-"):
        alpha = float(popularity.split("-", 1)[1])
        weights = [1.0 / (i + 1) ** alpha for i in range(n)]
        return rng.choices(range(n), weights=weights, k=n)
    if popularity == "identical":
        return [0] * n
    if popularity == "skewed":
        hot = (n + 1) // 2
        return [0] * hot + list(range(1, n - hot + 1))
    raise ValueError(f"unknown popularity {popularity!r}; choose one of {POPULARITIES}")


def segment_lengths(assignment: list[int]) -> list[int]:
    """Rows per adapter once the batch is grouped by adapter (first-seen order)."""
    counts: dict[int, int] = {}
    for a in assignment:
        counts[a] = counts.get(a, 0) + 1
    return list(counts.values())


def output_lengths(
    n: int, rng: random.Random, median: int = 24, sigma: float = 1.2, low: int = 2, high: int = 512
) -> list[int]:
    """Heavy-tailed generation lengths, ShareGPT-like in shape (log-normal, clipped to
    [low, high]): most answers short, a few very long. The defaults (median 24, mean ~48, 4%
    above 200) are ShareGPT's shape scaled down to what a CPU generates in a benchmark."""
    return [
        min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)
    ]


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival times (seconds from 0) of n requests at `rate` per second."""
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def zipf_sampler(n: int, alpha: float):
    """A function rng -> adapter index in [0, n) with Zipf(alpha) popularity, O(log n) a draw
    (assign_adapters draws a whole batch at once)."""
    import bisect
    import itertools

    cum = list(itertools.accumulate(1.0 / (i + 1) ** alpha for i in range(n)))

    def draw(rng: random.Random) -> int:
        return min(n - 1, bisect.bisect_left(cum, rng.random() * cum[-1]))

    return draw
