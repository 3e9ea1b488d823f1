"""How fast do one decoder layer's quantized projections run with x as float, int16 or int8?

The four projections of one decoder layer (q|k|v, o, gate|up, down) in ggml blocks (Q4_0, Q4_1
or Q8_0, random quants), multiplied by x of --rows rows in the serving dtype through
csrc/quant: `float` (quant_activations="float": x as it is, blocks widened to float32),
`int16` (the default) and `int8` (llama.cpp's arithmetic): x rounded per block of 32 and
integer dot products. --layers copies of the layer cycle (more bytes than the caches hold, as
a decode step reads them), every ISA build this CPU runs, modes interleaved over --rounds
(the median kept). GB/s: the blocks' bytes over the time; the machine's streaming rate
(torch.sum over 1 GB, 2 threads) is printed beside them as the floor's yardstick.

    python benchmarks/bench_quant_kernel.py [--model llama-3-8b|smollm2] [--rows 1 4]
"""

from __future__ import annotations

import statistics
import time

import torch
from common.args import add_rounds, add_threads, parser
from common.report import describe_machine, machine, print_table, pyplot, save_plot, write_json

from punica_x.ops import isa
from punica_x.ops.quant_dense import FORMATS, X_BITS, QuantCpuDense, random_blocks

LAYERS = {  # [N, K] of q|k|v, o, gate|up, down
    "llama-3-8b": ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)),
    "smollm2": ((960, 576), (576, 576), (3072, 576), (576, 1536)),
}
MODES = ("float", "int16", "int8")


def main() -> None:
    ap = parser(__doc__)
    add_threads(ap)
    add_rounds(ap, default=3)
    ap.add_argument("--model", default="llama-3-8b", choices=sorted(LAYERS))
    ap.add_argument("--formats", nargs="+", default=["Q4_0", "Q4_1", "Q8_0"], choices=FORMATS)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--layers", type=int, default=3, help="copies of the layer, cycled")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    if args.layers < 1 or args.rounds < 1 or min(args.rows) < 1:
        ap.error("--layers, --rounds and --rows must be >= 1")
    torch.set_num_threads(args.threads)
    print(describe_machine(), flush=True)
    dtype = getattr(torch, args.dtype)
    stream = stream_gb_s()
    print(f"streaming rate (torch.sum over 1 GB): {stream:.1f} GB/s", flush=True)
    rows = []
    for level in isa.runnable_levels()[:-1]:  # not generic
        for fmt in args.formats:
            rows += measure(level, fmt, dtype, args)
    for r in rows:
        r["x_int16"] = r["float_ms"] / r["int16_ms"]
        r["x_int8"] = r["float_ms"] / r["int8_ms"]
    cols = ["isa", "format", "rows", "MB", *[m + "_ms" for m in MODES]]
    cols += [m + "_GB_s" for m in MODES] + ["x_int16", "x_int8"]
    print_table(rows, cols, f"one {args.model} layer's projections, {args.dtype} x, ms per layer")
    name = "bench_quant_kernel" + ("" if args.model == "llama-3-8b" else f"_{args.model}")
    path = write_json(name, {"args": vars(args), "stream_GB_s": stream, "rows": rows})
    plot(rows, name, args.model, stream)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def measure(level: str, fmt: str, dtype: torch.dtype, args) -> list[dict]:
    """Rows (per x row count) of ms per layer and GB/s for every mode, on one ISA build."""
    shapes = LAYERS[args.model]
    ext = QuantCpuDense(fmt, dtype, level).ext
    ggml = FORMATS[fmt][0]
    weights = [[random_blocks(fmt, n, k) for n, k in shapes] for _ in range(args.layers)]
    # the integer modes' layout: rows grouped by 4 (the same bytes)
    grouped = [[ext.group_rows(w, ggml, k) for (_, k), w in zip(shapes, ws)] for ws in weights]
    nbytes = sum(w.numel() for w in weights[0])
    out = []
    for m in args.rows:
        xs = {k: torch.randn(m, k).to(dtype) for _, k in shapes}
        ys = {n: torch.empty(m, n, dtype=dtype) for n, _ in shapes}

        def layer(i: int, bits: int, xs=xs, ys=ys) -> None:
            at = i % args.layers
            for (n, k), w, g in zip(shapes, weights[at], grouped[at]):
                if bits:
                    ext.qgemm_grouped(ys[n], xs[k], g, ggml, None, bits)
                else:
                    ext.qgemm(ys[n], xs[k], w, ggml, None)

        times = {mode: [] for mode in MODES}
        for mode in MODES:  # warm-up: every copy once
            for i in range(args.layers):
                layer(i, X_BITS[mode])
        for _ in range(args.rounds):
            for mode in MODES:
                t0 = time.perf_counter()
                for i in range(args.layers):
                    layer(i, X_BITS[mode])
                times[mode].append((time.perf_counter() - t0) / args.layers)
        row = {"isa": level, "format": fmt, "rows": m, "MB": nbytes / 1e6}
        for mode in MODES:
            s = statistics.median(times[mode])
            row[mode + "_ms"] = s * 1e3
            row[mode + "_GB_s"] = nbytes / s / 1e9
        out.append(row)
        print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return out


def stream_gb_s() -> float:
    a = torch.ones(250_000_000)  # 1 GB of float32
    a.sum()
    t0 = time.perf_counter()
    for _ in range(3):
        a.sum()
    return 3 * a.numel() * 4 / (time.perf_counter() - t0) / 1e9


def plot(rows: list[dict], name: str, model: str, stream: float) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels = [f"{r['isa']}\n{r['format']} m={r['rows']}" for r in rows]
    width = 0.8 / len(MODES)
    for j, mode in enumerate(MODES):
        xs = [i + (j - 1) * width for i in range(len(rows))]
        ax.bar(xs, [r[mode + "_GB_s"] for r in rows], width, label=mode)
    ax.axhline(stream, color="grey", linestyle="--", label="torch.sum streaming")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("GB/s of blocks read")
    m = machine()
    ax.set_title(f"{model} layer, quantized projections by x's rounding ({m['cpu']})")
    ax.legend(fontsize=8)
    save_plot(name, fig)


if __name__ == "__main__":
    main()
