"""The batch-invariant mode on against off (ModelConfig.batch_invariant), two engines of one
process timed side by side: bench_invariance.py's question, and bench_generate's columns.

Every measurement runs both engines in an `order` ("on" first or "off" first, alternating by
round in invariance_rounds), so both see nearly the same machine (these VMs drift by tens of
percent over minutes), and each cost is the time ratio on / off within one round."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable

from common.engine_timing import paired_ratio, run_ours, start_decoding, stop_all
from punica_x import LLM, SamplingParams

MODES = ("on", "off")
_SALTS = itertools.count()


def paired_decode(engines: dict, order, prompts, adapters, sp, steps: int) -> dict[str, float]:
    """{mode: median step seconds} once every request decodes on both engines, their steps
    alternating in `order` for `steps` pairs (each pair of steps sees the same machine)."""
    for mode in order:
        start_decoding(engines[mode], prompts, adapters, sp)
    times: dict[str, list[float]] = {mode: [] for mode in order}
    for _ in range(steps):
        for mode in order:
            t0 = time.perf_counter()
            engines[mode].engine.step()
            times[mode].append(time.perf_counter() - t0)
    for llm in engines.values():
        stop_all(llm)
    return {mode: statistics.median(t) for mode, t in times.items()}


def paired_prefill(engines: dict, order, prompts, adapters) -> dict[str, float]:
    """{mode: seconds until every prompt has its first token}, measured in `order`."""
    return {mode: prefill_time(engines[mode], prompts, adapters) for mode in order}


def paired_generate(engines: dict, order, prompts, adapters, sp) -> dict[str, float]:
    """{mode: seconds of LLM.generate end to end (prefill and every token)}, in `order`."""
    tokens = len(prompts) * sp.max_tokens
    return {mode: tokens / run_ours(engines[mode], prompts, adapters, sp) for mode in order}


def prefill_time(llm: LLM, prompts, adapters) -> float:
    """Seconds until every prompt has its first token (a fresh cache salt each time, so no
    prefix is reused)."""
    engine = llm.engine
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    reqs = [
        engine.add_request(p, sp, a, cache_salt=f"prefill-{next(_SALTS)}")
        for p, a in zip(prompts, adapters)
    ]
    t0 = time.perf_counter()
    while not all(r.finished for r in reqs):
        engine.step()
    return time.perf_counter() - t0


def invariance_rounds(work: dict[str, Callable], rounds: int) -> dict[tuple[str, str], list]:
    """work: {name: measure(order) -> {mode: seconds}}. Every measure in each of `rounds`
    rounds, "on" first in even rounds and "off" first in odd ones. Returns
    {(name, mode): [seconds per round]}."""
    per_round: dict[tuple[str, str], list] = {(w, m): [] for w in work for m in MODES}
    for r in range(rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        for w, measure in work.items():
            for m, seconds in measure(order).items():
                per_round[(w, m)].append(seconds)
    return per_round


def cost(per_round: dict, name: str) -> dict[str, float]:
    """`name`'s on / off time ratio paired by round: {"median", "min", "max"}."""
    return paired_ratio(per_round[(name, "on")], per_round[(name, "off")])
