"""Which dense backend is fastest for the backbone's projections on this CPU, and by how much?

SmolLM2-135M's weight shapes ([N, K]: q|k|v 960x576, o 576x576, gate|up 3072x576, down
576x1536, lm_head 49152x576), float32 or bfloat16 (--dtype), x of M rows (decode steps of
1..64 requests, 256-row prefill chunks), weights packed once where the backend packs:
* cpu-<isa>: punica-x's hand-written packed GEMM (csrc/dense), every ISA build this CPU runs
  (bf16: vdpbf16ps on K pairs in the avx512_bf16 build, widened to float32 in the others)
* onednn: oneDNN's linear on a weight reordered once (torch.ops.mkldnn._reorder_linear_weight)
* mkl_packed: MKL's packed sgemm (torch.ops.mkl._mkl_linear), packed for M = 32; at any other
  M torch runs it unpacked, so only its M = 32 column shows the pack (float32 only)
* torch: x @ W_t with W_t [K, N] contiguous; F.linear: x @ W^T (what nn.Linear does)
Backends are interleaved over rounds (the machine's speed drifts); the median is kept.

    python benchmarks/bench_dense.py [--threads 2] [--rounds 5] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import statistics
import time

import torch
from common.args import add_rounds, add_threads, parser
from common.report import describe_machine, machine, print_table, pyplot, save_plot, write_json

from punica_x.ops import isa
from punica_x.ops.dense import OneDnnDense, PackedCpuDense, TorchDense

SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
ROWS = (1, 8, 32, 64, 256)
MKL_PACK_M = 32


def backends(n: int, k: int, dtype: torch.dtype = torch.float32) -> dict:
    """name -> run(x) for an [n, k] weight (prepared once)."""
    w = (torch.randn(n, k) * k**-0.5).to(dtype)

    def prepared(backend):
        p = backend.prepare(w)
        return lambda x: backend.forward(x, p, n, None)

    out = {}
    for level in [lvl for lvl in isa.runnable_levels() if lvl != "generic"]:
        out[f"cpu-{level}"] = prepared(PackedCpuDense(level))
    if torch.backends.mkldnn.is_available():
        out["onednn"] = prepared(OneDnnDense())
    if torch.backends.mkl.is_available() and dtype == torch.float32:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, MKL_PACK_M)
        out["mkl_packed"] = lambda x: torch.ops.mkl._mkl_linear(x, packed, w, None, MKL_PACK_M)
    out["torch"] = prepared(TorchDense())
    out["F.linear"] = lambda x: torch.nn.functional.linear(x, w)
    return out


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = parser(__doc__)
    add_threads(ap)
    add_rounds(ap, 5)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    # bf16 outputs are rounded once to 8 bits of mantissa (~0.4%); float32 agree to 1e-3
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    torch.set_num_threads(args.threads)
    print(describe_machine(), flush=True)
    rows = []
    names: list[str] = []
    for shape, (n, k) in SHAPES.items():
        fns = backends(n, k, dtype)
        names = list(fns)
        for m in ROWS:
            if shape == "lm_head" and m > 64:
                continue  # the head only sees sampled rows
            x = torch.randn(m, k).to(dtype)
            ref = fns["torch"](x).float()
            for fn in fns.values():
                torch.testing.assert_close(fn(x).float(), ref, rtol=tol, atol=tol)
            samples: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    samples[name].append(timed(lambda fn=fn, x=x: fn(x), args.repeats))
            row = {"shape": shape, "N": n, "K": k, "M": m}
            flops = 2 * m * n * k
            for name, s in samples.items():
                row[f"{name}_GFs"] = flops / statistics.median(s) / 1e9
            others = [row[f"{c}_GFs"] for c in names if not c.startswith("cpu-")]
            ours = [row[f"{c}_GFs"] for c in names if c.startswith("cpu-")]
            row["best"] = max(names, key=lambda c: row[f"{c}_GFs"])
            if ours:
                row["hand_vs_best_library"] = max(ours) / max(others)
            rows.append(row)
            print(
                f"{shape:8s} M={m:4d} "
                + "  ".join(f"{c} {row[f'{c}_GFs']:.0f}" for c in names)
                + f"  GFLOP/s -> {row['best']}",
                flush=True,
            )
    cols = ["shape", "M", *(f"{c}_GFs" for c in names), "best", "hand_vs_best_library"]
    print_table(rows, cols, "GFLOP/s (higher is better), median over interleaved rounds")
    wins = [r for r in rows if r.get("hand_vs_best_library", 0) > 1]
    print(f"\nhand-written kernel fastest in {len(wins)} of {len(rows)} (shape, M) points")
    name = "bench_dense" if dtype == torch.float32 else f"bench_dense_{args.dtype}"
    path = write_json(name, {"args": vars(args), "backends": names, "rows": rows})
    plot(rows, names, name, args.dtype)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def plot(rows, names, name: str = "bench_dense", dtype: str = "float32") -> None:
    plt = pyplot()
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(18, 3.6), sharey=True)
    for ax, shape in zip(axes, shapes):
        sub = [r for r in rows if r["shape"] == shape]
        for backend in names:
            ax.plot([r["M"] for r in sub], [r[f"{backend}_GFs"] for r in sub], "o-", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{shape} {sub[0]['N']}x{sub[0]['K']}")
        ax.set_xlabel("rows M")
    axes[0].set_ylabel("GFLOP/s")
    axes[-1].legend(fontsize=7)
    m = machine()
    fig.suptitle(f"dense backends, {dtype}, {m['cpu']} ({m['isa']}), {m['threads']} threads")
    save_plot(name, fig)


if __name__ == "__main__":
    main()
