"""Is SGMV faster than Loop and Gather-BMM, and how close to the memory floor? (Punica 7.1)

LoRA add-on y += x @ A_i @ B_i (shrink + expand), h = 4096, r = 16, float32 on CPU, over the
adapter-popularity workloads at batch 1..64. Weights are cold: every call reads adapters
that the previous calls did not touch (a pool several times the last-level cache), as a
server with many tenants would. Floor = bytes moved (unique adapters' weights + x read +
y read and written) / measured copy bandwidth.

    python benchmarks/bench_sgmv.py [--threads 2] [--repeats 30]
    python benchmarks/bench_sgmv.py --device cuda [--dtype float16]   # -> bench_sgmv_cuda.json
"""

from __future__ import annotations

import random

import torch
from common.args import add_threads, parser
from common.report import describe_machine, print_table, pyplot, save_plot, write_json
from common.timing import copy_bandwidth, measure
from common.workload import WORKLOADS

from punica_x.ops.sgmv import SgmvWeights, add_lora_sgmv, get_backend
from punica_x.workloads import assign_adapters, segment_lengths

H, R = 4096, 16
BATCHES = (1, 2, 4, 8, 16, 32, 48, 64)
POOL_BYTES = 256 << 20  # >> last-level cache, so weights come from DRAM


class AdapterPool:
    """Many rank-R adapters; take() hands out ones not used by recent calls."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        per = 2 * R * H * dtype.itemsize
        opts = dict(device=device, dtype=dtype)
        self.a = [torch.randn(1, R, H, **opts) * 0.01 for _ in range(POOL_BYTES // per)]  # A^T
        self.b = [torch.randn(1, R * H, **opts) * 0.01 for _ in range(len(self.a))]  # B [1, r*h]
        self.next = 0

    def take(self, n: int) -> list[int]:
        if self.next + n > len(self.a):
            self.next = 0
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


def methods(pool: AdapterPool, lens: list[int], x: torch.Tensor, y: torch.Tensor):
    seg = [0]
    for n in lens:
        seg.append(seg[-1] + n)
    state: dict = {}
    backend = get_backend(x.device)
    workspace = torch.zeros(x.shape[0], R, device=x.device)

    def pick():
        ids = pool.take(len(lens))
        state["ids"] = ids
        state["w"] = SgmvWeights.build(
            seg, [pool.a[i] for i in ids], [pool.b[i] for i in ids], [[R]] * len(ids), [H], x.device
        )
        state["rows"] = [ids[s] for s, n in enumerate(lens) for _ in range(n)]

    def loop():
        for s, i in enumerate(state["ids"]):
            lo, hi = seg[s], seg[s + 1]
            y[lo:hi] += (x[lo:hi] @ pool.a[i][0].t()) @ pool.b[i].view(R, H)

    def gather_bmm():
        wa = torch.stack([pool.a[i][0].t() for i in state["rows"]])  # [B, h, r]
        wb = torch.stack([pool.b[i].view(R, H) for i in state["rows"]])  # [B, r, h]
        y.add_(torch.bmm(torch.bmm(x.unsqueeze(1), wa), wb).squeeze(1))

    def sgmv():
        add_lora_sgmv(y, x, state["w"], 0, workspace, backend)

    fns = {"loop": loop, "gather_bmm": gather_bmm, "sgmv": sgmv}
    if x.device.type == "cuda":  # the same values one element off 16 bytes: the split-K shrink
        x_off = torch.empty(x.shape[0], x.shape[1] + 1, device=x.device, dtype=x.dtype)[:, 1:]
        x_off.copy_(x)
        fns["sgmv_split_k"] = lambda: add_lora_sgmv(y, x_off, state["w"], 0, workspace, backend)
    return pick, fns


def check_correct(pool: AdapterPool, device, dtype) -> None:
    lens = [3, 1, 2]
    x, y = (
        torch.randn(6, H, device=device, dtype=dtype),
        torch.zeros(6, H, device=device, dtype=dtype),
    )
    pick, fns = methods(pool, lens, x, y)
    pick()
    outs = {}
    for name, fn in fns.items():
        y.zero_()
        fn()
        outs[name] = y.clone()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for name in set(outs) - {"loop"}:
        torch.testing.assert_close(outs[name], outs["loop"], rtol=tol, atol=tol)


COLUMNS = [
    "workload",
    "batch",
    "adapters",
    "loop_ms",
    "gather_bmm_ms",
    "sgmv_ms",
    "floor_ms",
    "sgmv_GBps",
    "sgmv_vs_best_baseline",
    "sgmv_vs_floor",
]
# CUDA: the split-K shrink (x not in 16-byte units, adds into a zeroed v; before 2026-11-27
# every multi-row segment took it) beside the write-once row-tile kernel, in the same run.
CUDA_COLUMNS = [*COLUMNS, "sgmv_split_k_ms", "write_vs_split_k"]


def time_methods(
    pool: AdapterPool, label: str, popularity: str, batch: int, bandwidth: float, repeats: int
) -> dict:
    """One (workload, batch) point: median ms per call of each method on cold weights, and
    the floor (bytes moved / copy bandwidth)."""
    device, dtype = pool.a[0].device, pool.a[0].dtype
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    size = dtype.itemsize
    lens = segment_lengths(assign_adapters(popularity, batch, random.Random(batch)))
    x = torch.randn(batch, H, device=device, dtype=dtype)
    y = torch.zeros(batch, H, device=device, dtype=dtype)
    pick, fns = methods(pool, lens, x, y)
    nbytes = len(lens) * 2 * R * H * size + 3 * batch * H * size
    row = {
        "workload": label,
        "batch": batch,
        "adapters": len(lens),
        "floor_ms": nbytes / bandwidth * 1e3,
    }
    for name, fn in fns.items():
        timed = lambda fn=fn: (fn(), sync())
        row[f"{name}_ms"] = measure(timed, repeats=repeats, between=pick).median * 1e3
    row["sgmv_GBps"] = nbytes / (row["sgmv_ms"] / 1e3) / 1e9
    row["sgmv_vs_best_baseline"] = row["sgmv_ms"] / min(row["loop_ms"], row["gather_bmm_ms"])
    row["sgmv_vs_floor"] = row["sgmv_ms"] / row["floor_ms"]
    if "sgmv_split_k_ms" in row:
        row["write_vs_split_k"] = row["sgmv_ms"] / row["sgmv_split_k_ms"]
    return row


def main() -> None:
    ap = parser(__doc__)
    add_threads(ap)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None, help="float32 on cpu (default), float16 on cuda")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="rows per call")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    print(describe_machine(), flush=True)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "float16"))
    bandwidth = copy_bandwidth(device=device)
    pool = AdapterPool(device, dtype)
    check_correct(pool, device, dtype)
    rows = [
        time_methods(pool, label, popularity, batch, bandwidth, args.repeats)
        for label, popularity in WORKLOADS.items()
        for batch in batches
    ]
    print(
        f"{args.device}: copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write), "
        f"{args.threads} threads, h={H} r={R} {dtype}"
    )
    columns = CUDA_COLUMNS if device.type == "cuda" else COLUMNS
    print_table(rows, columns, "SGMV shrink+expand, median ms per call (cold weights)")
    worst = max(r["sgmv_vs_best_baseline"] for r in rows)
    print(f"\nworst sgmv / min(loop, gather_bmm) = {worst:.2f} (target <= 1.0)")
    for d in (r for r in rows if r["workload"] == "distinct" and r["batch"] == 64):
        print(f"distinct batch 64: sgmv / floor = {d['sgmv_vs_floor']:.2f} (target <= 1.3)")
    name, group = "bench_sgmv", (None if device.type == "cpu" else "cuda")
    path = write_json(
        name,
        {
            "device": args.device,
            "dtype": str(dtype),
            "copy_bandwidth_GBps": bandwidth / 1e9,
            "h": H,
            "r": R,
            "threads": args.threads,
            "rows": rows,
        },
        group,
    )
    plot(rows, name, group)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def plot(rows, name: str, group: str | None) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(16, 3.8), sharey=True)
    for ax, label in zip(axes, WORKLOADS):
        sub = [r for r in rows if r["workload"] == label]
        xs = [r["batch"] for r in sub]
        for key, style in (
            ("loop_ms", "o-"),
            ("gather_bmm_ms", "s-"),
            ("sgmv_ms", "^-"),
            ("floor_ms", "k--"),
        ):
            ax.plot(xs, [r[key] for r in sub], style, label=key.removesuffix("_ms"))
        ax.set_title(label)
        ax.set_xlabel("batch size")
        ax.set_yscale("log")
    axes[0].set_ylabel("ms per LoRA add-on (h=4096, r=16)")
    axes[-1].legend()
    save_plot(name, fig, group)


if __name__ == "__main__":
    main()
