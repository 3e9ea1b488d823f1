"""What do logprobs and JSON-schema constrained decoding cost the other requests of a batch?

SmolLM2-135M-Instruct, 32 requests decoding over 8 rank-16 adapters and the base model. The
same 32-request batch is timed (median decode step, every request past its prompt) as:
* plain: no request asks for anything;
* logprobs: 8 of them ask for logprobs with 5 alternatives;
* constrained: 8 of them are constrained by a JSON schema (an array of 300+ integers, so they
  keep decoding through the timed steps);
* both: 8 logprobs + 8 constrained.
A step is shared by the whole batch, so the step-time ratio to `plain` is how much every
unconstrained request slows (target <= 1.05). Configurations are interleaved over rounds.

    python benchmarks/bench_sampling_features.py [--rounds 3] [--steps 15]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common.args import add_requests, add_rounds, add_threads
from common.engine_timing import decode_step_time
from common.report import describe_machine, print_table, pyplot, save_plot, write_json
from common.scratch import scratch_dir
from common.workload import load_adapters, make_adapters, make_prompts

from punica_x import LLM, SamplingParams
from punica_x.sampling.structured import canonical_schema

SCHEMA = canonical_schema(
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 300}
)
CONFIGS = {
    "plain": (0, 0),
    "logprobs": (8, 0),
    "constrained": (0, 8),
    "both": (8, 8),
}


def params(n: int, logprobs: int, constrained: int, max_tokens: int) -> list[SamplingParams]:
    out = []
    for i in range(n):
        kw = {}
        if i < logprobs:
            kw["logprobs"] = 5
        elif i < logprobs + constrained:
            kw["json_schema"] = SCHEMA
        out.append(SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_requests(ap)
    add_threads(ap)
    add_rounds(ap)
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(describe_machine(), flush=True)
    llm = LLM()
    n = args.requests
    prompts = make_prompts(llm.tokenizer, n)
    tmp = scratch_dir("bench-sampling-")
    paths = make_adapters(llm.engine.loaded.model_dir, 8, 16, tmp)
    load_adapters(llm, paths)
    adapters = [f"a{i % 8}" if i % 9 else None for i in range(n)]
    max_tokens = 20 + args.steps + 8
    decode_step_time(
        llm, prompts, adapters, params(n, 8, 8, max_tokens), 2
    )  # warm: grammar, kernels
    samples: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for _ in range(args.rounds):
        for name, (lp, cons) in CONFIGS.items():
            sps = params(n, lp, cons, max_tokens)
            samples[name].append(decode_step_time(llm, prompts, adapters, sps, args.steps))
    plain = statistics.median(samples["plain"])
    rows = []
    for name, (lp, cons) in CONFIGS.items():
        t = statistics.median(samples[name])
        rows.append(
            {
                "config": name,
                "logprobs_requests": lp,
                "constrained_requests": cons,
                "step_ms": t * 1e3,
                "x_plain": t / plain,
            }
        )
    print_table(rows, list(rows[0]), f"{n} requests decoding, median decode step")
    worst = max(r["x_plain"] for r in rows)
    print(f"\nworst step / plain step = {worst:.3f} (target <= 1.05)")
    path = write_json("bench_sampling_features", {"args": vars(args), "rows": rows})
    plot(rows)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def plot(rows) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar([r["config"] for r in rows], [r["step_ms"] for r in rows])
    ax.set_ylabel("decode step ms (32 requests)")
    ax.set_title("cost of logprobs and constrained rows")
    save_plot("bench_sampling_features", fig)


if __name__ == "__main__":
    main()
