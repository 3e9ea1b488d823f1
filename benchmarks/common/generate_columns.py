"""bench_generate's columns beside punica-x's own tok/s (vLLM's are common/vllm_rows.py's),
each added to the rows of its workloads: HF transformers + PEFT on the --hf-workloads (a
mixed-adapter batch and one adapter at a time, with the backbone's tok/s), a float32
punica-x engine on the same workloads (when punica-x serves another dtype), each
workload's tok/s with --heap-objects more live Python objects (a grown server heap), and the
batch-invariant mode's cost per workload (--batch-invariant both: invariance_table)."""

from __future__ import annotations

import statistics
from pathlib import Path

from common.engine_timing import run_ours, warm_up
from common.hf_baselines import HFBaselines
from common.workload import load_adapters
from punica_x import LLM


def heap_effect(llm: LLM, prompts, names: dict, sp, objects: int, rounds: int) -> dict:
    """Median tok/s per workload without and with `objects` more live container objects
    (made after start-up, not frozen), interleaved over `rounds`: {workload: (fresh, heap)}."""
    import gc

    fresh: dict[str, list[float]] = {w: [] for w in names}
    heavy: dict[str, list[float]] = {w: [] for w in names}
    for _ in range(rounds):
        for w, adapters in names.items():
            fresh[w].append(run_ours(llm, prompts, adapters, sp))
        heap = [[i] for i in range(objects)]  # one tracked list each
        for w, adapters in names.items():
            heavy[w].append(run_ours(llm, prompts, adapters, sp))
        del heap
        gc.collect()
    return {w: (statistics.median(fresh[w]), statistics.median(heavy[w])) for w in names}


def add_heap(rows, args, llm: LLM, prompts, names, sp) -> None:
    """tok/s with --heap-objects more live objects (heap_tok_s), and over without (x_heap)."""
    heap = heap_effect(llm, prompts, names, sp, args.heap_objects, args.rounds)
    for row in rows:
        fresh, heavy = heap[row["workload"]]
        row["heap_tok_s"], row["x_heap"] = heavy, heavy / fresh


def add_fp32(rows, prompts, paths, names, sp, model: str | None = None) -> Path:
    """A float32 punica-x engine on the same workloads (ours_fp32_tok_s, x_fp32 = the served
    dtype over float32); returns the model's folder."""
    fp32 = LLM(dtype="float32", model=model, quantization="none")  # HF's reference weights
    load_adapters(fp32, paths)
    warm_up(fp32, prompts)
    for row in rows:
        row["ours_fp32_tok_s"] = run_ours(fp32, prompts, names[row["workload"]], sp)
        row["x_fp32"] = row["ours_tok_s"] / row["ours_fp32_tok_s"]
    return fp32.engine.loaded.model_dir


def add_hf(rows, args, model_dir: Path, paths, prompts, names) -> float:
    """HF + PEFT on the --hf-workloads (mixed batch, one adapter at a time) into the rows;
    returns HF's backbone tok/s."""
    hf_workloads = [w for w in args.hf_workloads.split(",") if w]
    hf = HFBaselines(model_dir, paths)
    hf.backbone(prompts[:4], 4)  # warm-up
    hf_backbone = hf.backbone(prompts, args.max_tokens)
    for row in rows:
        w = row["workload"]
        if w not in hf_workloads:
            continue
        row["hf_mixed_tok_s"] = hf.mixed(prompts, names[w], args.max_tokens)
        row["hf_one_at_a_time_tok_s"] = hf.one_at_a_time(prompts, names[w], args.max_tokens)
        row["x_hf_mixed"] = row["ours_tok_s"] / row["hf_mixed_tok_s"]
        row["x_hf_one_at_a_time"] = row["ours_tok_s"] / row["hf_one_at_a_time_tok_s"]
    return hf_backbone


INVARIANCE_COLUMNS = ["workload", "on_tok_s", "off_tok_s", "generate", "decode", "prefill"]


def invariance_table(args, model, prompts, paths, names: dict, sp) -> list[dict]:
    """--batch-invariant both: engines with the mode on and off (the served dtype and
    weights), every workload and the backbone in each of --rounds rounds, the engines
    alternating (common.invariance_pairs): generate end to end, the decode step once all
    requests decode, and the batch's prefill (its first tokens). A row per workload: on's and
    off's tok/s end to end (medians) and each time's on / off ratio paired by round (median;
    the range in the JSON's *_range)."""
    from common.invariance_pairs import (
        MODES,
        cost,
        invariance_rounds,
        paired_decode,
        paired_generate,
        paired_prefill,
    )

    engines = {
        m: LLM(dtype=args.dtype, model=model, quantization=args.quantization, batch_invariant=m)
        for m in MODES
    }
    for llm in engines.values():
        load_adapters(llm, paths)
        warm_up(llm, prompts)
    work = {}
    for w, adapters in {**names, "backbone": [None] * len(prompts)}.items():
        work[f"{w}/generate"] = lambda o, a=adapters: paired_generate(engines, o, prompts, a, sp)
        work[f"{w}/decode"] = lambda o, a=adapters: paired_decode(
            engines, o, prompts, a, sp, args.decode_steps
        )
        work[f"{w}/prefill"] = lambda o, a=adapters: paired_prefill(engines, o, prompts, a)
    per_round = invariance_rounds(work, args.rounds)
    tokens = len(prompts) * sp.max_tokens
    rows = []
    for w in [*names, "backbone"]:
        row = {"workload": w}
        for m in MODES:
            row[f"{m}_tok_s"] = tokens / statistics.median(per_round[(f"{w}/generate", m)])
        for part in ("generate", "decode", "prefill"):
            ratio = cost(per_round, f"{w}/{part}")
            row[part], row[f"{part}_range"] = ratio["median"], [ratio["min"], ratio["max"]]
        rows.append(row)
    return rows
