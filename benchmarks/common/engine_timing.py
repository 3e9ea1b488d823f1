"""punica-x's engine timed on a batch: generated tokens/s end to end, and the median step
time once every request is decoding."""

from __future__ import annotations

import statistics
import time

from punica_x import LLM, SamplingParams


def run_ours(llm: LLM, prompts, adapters, sp) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, adapters, sp)
    elapsed = time.perf_counter() - t0
    assert all(len(o.token_ids) == sp.max_tokens for o in outs)
    return sum(len(o.token_ids) for o in outs) / elapsed


def warm_up(llm: LLM, prompts) -> None:
    """4 tokens for the first 4 prompts on the base model (kernels, pools, first steps)."""
    first = prompts[:4]
    run_ours(llm, first, [None] * len(first), SamplingParams(max_tokens=4, ignore_eos=True))


def decode_step_time(llm: LLM, prompts, adapters, sp, steps: int) -> float:
    """Median seconds of a step once every request is decoding. sp: one SamplingParams for
    all, or one per request.

    Request i gets the cache salt "decode-step-i" (unique_salts), so the batch's requests share
    no KV blocks whatever their adapters and every workload's attention reads the same bytes.
    Unsalted, the base model's requests shared their chat template's first blocks, which
    requests of distinct adapters cannot, and the backbone's step was cheaper by that and not
    by LoRA (SmolLM2 bf16, 32 requests, Zen 4, 2026-11-26: Distinct's attention over the
    backbone's +1.0-1.4 ms a step unsalted, +0.4-0.6 salted, +0.1 with prefix caching off;
    the rest follows the rows' order, which sorting by adapter changes)."""
    engine = start_decoding(llm, prompts, adapters, sp)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    stop_all(llm)
    return statistics.median(times)


def start_decoding(llm: LLM, prompts, adapters, sp):
    """Add the requests (decode_step_time's salts) and step until every one decodes; returns
    the engine."""
    engine = llm.engine
    sps = sp if isinstance(sp, (list, tuple)) else [sp] * len(prompts)
    for p, a, one, salt in zip(prompts, adapters, sps, unique_salts("decode-step", len(prompts))):
        engine.add_request(p, one, a, cache_salt=salt)
    while any(
        r.num_computed_tokens < r.num_tokens - 1 or not r.output_token_ids
        for r in engine.requests.values()
    ):
        engine.step()
    return engine


def stop_all(llm: LLM) -> None:
    """Abort every request of the engine."""
    for rid in list(llm.engine.requests):
        llm.engine.abort(rid)


def unique_salts(prefix: str, n: int) -> list[str]:
    """A cache salt per request (Engine.add_request): with them, n requests reuse no KV block
    of one another; request i of a later batch may reuse request i's blocks (same salt, same
    adapter), which skips its prefill but not its decode reads."""
    return [f"{prefix}-{i}" for i in range(n)]


def interleaved_rounds(configs: dict, rounds: int, measure, between=None) -> dict[str, list]:
    """measure(config value) for every config in every round, the configs' order reversed
    on odd rounds so that each config's neighbours even out the machine's drift (a VM's
    speed moves by tens of percent over minutes; configs measured next to each other see
    nearly the same machine). between(round) runs first in every round. Returns
    {config: [one value per round]}."""
    per_round: dict[str, list] = {c: [] for c in configs}
    order = list(configs)
    for r in range(rounds):
        if between is not None:
            between(r)
        for c in order if r % 2 == 0 else reversed(order):
            per_round[c].append(measure(configs[c]))
    return per_round


def paired_ratio(num: list[float], den: list[float]) -> dict[str, float]:
    """The ratio num[r] / den[r] of values measured in the same round (interleaved_rounds),
    over rounds: {"median", "min", "max"}. Pairing by round cancels the drift a ratio of
    two medians over the whole run keeps."""
    if not num or len(num) != len(den):
        raise ValueError(f"need one value of each per round, got {len(num)} and {len(den)}")
    ratios = [a / b for a, b in zip(num, den)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
