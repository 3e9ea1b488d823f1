"""Where does a decode step's time go? (per component, at batch 32)

SmolLM2-135M-Instruct, --requests requests all decoding (prompts of ~40 tokens plus a few
generated ones), without adapters and with rank-16 adapters on all 7 projections
(Distinct: one adapter per request; Identical: one adapter for all), each request with its
own cache salt (no KV blocks shared, as in common/engine_timing). Every backend call of
the engine (dense projections, lm_head, SGMV, attention, KV writes, fused element-wise ops;
attention includes RoPE and the K/V write where a layer does the three in one call, steps
without long prefills) and every step phase (scheduling, planning, the model call,
sampling, post-processing) is wrapped with a timer;
CPU kernels are synchronous, so the wall time of a call is its cost. The model's remainder
(embedding, views, Python between kernels) is the model call minus its timed parts.

    python benchmarks/profile_step.py [--requests 32] [--steps 20]
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict

import torch
from common.args import (
    add_rank,
    add_requests,
    add_shape_model,
    add_threads,
    check_shape_model,
    parser,
)
from common.engine_timing import unique_salts
from common.report import describe_machine, print_table, pyplot, save_plot, write_json
from common.scratch import scratch_dir
from common.shapes import SHAPES, model_path
from common.workload import (
    load_adapters,
    make_adapters,
    make_prompts,
    weights_dir,
    workload_names,
)

from punica_x import LLM, SamplingParams
from punica_x.attention.cpu import CpuAttentionPlan
from punica_x.config import dtype_name

MODEL_PARTS = ["dense", "lm_head", "sgmv", "attention", "kv_write", "elementwise"]
STEP_PARTS = ["schedule", "plan", "sample", "postprocess"]


class Timers:
    """Accumulated seconds per component; wrap() times every call of an attribute."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def timed(self, name, fn, key=None):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key(*args, **kwargs) if key else name] += time.perf_counter() - t0

        return wrapper

    def wrap(self, obj, attr: str, name: str, key=None) -> None:
        setattr(obj, attr, self.timed(name, getattr(obj, attr), key))


def instrument(llm: LLM, timers: Timers, vocab: int) -> None:
    engine = llm.engine
    model = engine.model
    backends = {id(m.backend): m.backend for m in model.modules() if hasattr(m, "backend")}
    for dense in backends.values():  # each shape may have its own backend (autotune)
        timers.wrap(
            dense, "forward", "dense", key=lambda x, w, n, *_: "lm_head" if n == vocab else "dense"
        )
    timers.wrap(engine.sgmv, "add_lora", "sgmv")
    bind = engine.sgmv.bind  # the model calls the launches bound per step plan
    engine.sgmv.bind = lambda w: timers.timed("sgmv", bind(w))
    for op in ("rms_norm", "add_rms_norm", "rope_", "silu_and_mul"):
        timers.wrap(model.fused, op, "elementwise")
    CpuAttentionPlan.attend = timers.timed("attention", CpuAttentionPlan.attend)
    # RoPE, the K/V write and attention of a layer in one call (steps without long prefills)
    fused_attention = CpuAttentionPlan.rope_write_attend
    CpuAttentionPlan.rope_write_attend = timers.timed("attention", fused_attention)
    CpuAttentionPlan.write_kv = timers.timed("kv_write", CpuAttentionPlan.write_kv)
    timers.wrap(engine.batcher, "schedule", "schedule")
    timers.wrap(engine.planner, "plan", "plan")
    timers.wrap(model, "forward", "model")
    timers.wrap(engine, "sampler", "sample")
    timers.wrap(engine, "_postprocess", "postprocess")


def profile(llm: LLM, timers: Timers, prompts, adapters, steps: int) -> dict[str, float]:
    """Milliseconds per decode step of each component, over `steps` steps."""
    engine = llm.engine
    sp = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for p, a, salt in zip(prompts, adapters, unique_salts("profile", len(prompts))):
        engine.add_request(p, sp, a, cache_salt=salt)  # no KV shared: decode_step_time
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    timers.seconds.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter() - t0
    for rid in list(engine.requests):
        engine.abort(rid)
    if any(a is not None for a in adapters) and not timers.seconds.get("sgmv"):
        raise RuntimeError("no SGMV call was timed: the engine's LoRA path bypasses the timers")
    ms = {k: v / steps * 1e3 for k, v in timers.seconds.items()}
    ms["model_other"] = ms["model"] - sum(ms.get(k, 0.0) for k in MODEL_PARTS)
    ms["step"] = total / steps * 1e3
    ms["step_other"] = ms["step"] - ms["model"] - sum(ms.get(k, 0.0) for k in STEP_PARTS)
    return ms


def parse_args():
    ap = parser(__doc__)
    add_requests(ap)
    ap.add_argument("--steps", type=int, default=20)
    add_rank(ap)
    add_threads(ap)
    ap.add_argument("--dtype", default="auto", help="serving dtype (auto: this CPU's default)")
    ap.add_argument(
        "--quantization", default="none", help="none | auto (a GGUF file's blocks) | int8 | int4"
    )
    ap.add_argument(
        "--quant-activations",
        default="int16",
        choices=["int16", "int8", "float"],
        help="how x meets weights in blocks (ModelConfig.quant_activations)",
    )
    add_shape_model(ap)
    args = ap.parse_args()
    check_shape_model(ap, args)
    return args


def result_name(args, dtype: str) -> str:
    """profile_step for float32 at batch 32, with the dtype, quantization, activations, batch
    and model shape appended where they differ from that."""
    name = "profile_step" if dtype == "float32" else f"profile_step_{dtype}"
    if args.quantization != "none":
        name += f"_q{args.quantization}"
        if args.quant_activations != "int16":
            name += f"_x{args.quant_activations}"
    if args.requests != 32:
        name += f"_batch{args.requests}"
    if args.model in SHAPES:
        name += f"_{args.model.replace('.', '_')}"
    return name


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    print(describe_machine(), flush=True)
    n = args.requests

    llm = LLM(
        dtype=args.dtype,
        model=model_path(args.model, args.tokenizer),
        quantization=args.quantization,
        quant_activations=args.quant_activations,
    )
    dtype = dtype_name(llm.engine.dtype)
    name = result_name(args, dtype)
    prompts = make_prompts(llm.tokenizer, n)
    tmp = scratch_dir("profile-step-")
    load_adapters(llm, make_adapters(weights_dir(llm, args.model), n, args.rank, tmp))
    timers = Timers()
    instrument(llm, timers, llm.engine.model.lm_head.out_features)
    configs = {"backbone": [None] * n, **workload_names(n, ("distinct", "identical"))}
    profile(llm, timers, prompts[:4], [None] * 4, 2)  # warm-up
    results = {c: profile(llm, timers, prompts, a, args.steps) for c, a in configs.items()}

    parts = [*MODEL_PARTS, "model_other", *STEP_PARTS, "step_other"]
    rows = component_rows(results, list(configs), parts)
    what = args.model or "SmolLM2-135M"
    print(f"{what} {dtype}, {n} requests decoding, {args.threads} threads, ms per step")
    print_table(rows, ["component", *(f"{c}_{k}" for c in configs for k in ("ms", "share"))])
    path = write_json(name, {"args": vars(args), "dtype": dtype, "rows": rows})
    print(f"wrote {path} and {plot(results, list(configs), parts, n, dtype, name)}")


def component_rows(results: dict, configs: list[str], parts: list[str]) -> list[dict]:
    """A row per part and one for the whole step: each configuration's ms per step and its
    share of that configuration's step."""
    return [
        {
            "component": p,
            **{f"{c}_ms": results[c].get(p, 0.0) for c in configs},
            **{f"{c}_share": results[c].get(p, 0.0) / results[c]["step"] for c in configs},
        }
        for p in [*parts, "step"]
    ]


def plot(results: dict, configs: list[str], parts: list[str], n: int, dtype: str, name: str):
    """Each configuration's step as stacked bars of its parts; returns the PNG's path."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.4))
    left = {c: 0.0 for c in configs}
    for i, p in enumerate(parts):
        values = [results[c].get(p, 0.0) for c in configs]
        lefts = [left[c] for c in configs]
        ax.barh(list(configs), values, left=lefts, label=p, color=plt.cm.tab20(i))
        for c, v in zip(configs, values):
            left[c] += v
    ax.set_xlabel("ms per decode step")
    ax.set_title(f"Where a decode step's time goes (batch {n}, {dtype})")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    return save_plot(name, fig)


if __name__ == "__main__":
    main()
