"""How long until a new process serves the default model? (what a runner that autoscale adds,
a restarted server or a recovered Ray runner waits before its first token)

Each round starts a fresh Python process (the kernels already built and the model's cache
entries made, as on a machine that served before) and times its phases:

- import: `import punica_x` and transformers (which the tokenizer and config need);
- load: LLM() with the default model (its GGUF file read natively: Q4_1 / Q8_0 blocks), the
  dtype --dtype (auto: bfloat16 where the CPU has BF16, else float32) and
  batch_invariant=auto (its cost measured on the model's shapes);
- first token: one greedy token of a short prompt;

and, in this process, the GGUF header of the default model read by models.gguf_header
against gguf.GGUFReader (what the load used before; --no-reader leaves it out).
Median, min and max of --rounds rounds.

    python benchmarks/bench_startup.py [--rounds 5] [--dtype auto] [--no-reader]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from common.args import add_dtype, add_rounds, add_threads, parser
from common.report import describe_machine, print_table, pyplot, save_plot, write_json

PHASES = ("import", "load", "first_token")


def child(args) -> None:
    """One fresh process's phases, printed as JSON on the last line."""
    started = time.perf_counter()
    import torch
    import transformers  # noqa: F401  (the tokenizer's and config's)

    from punica_x import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    imported = time.perf_counter()
    llm = LLM(dtype=args.dtype)
    loaded = time.perf_counter()
    llm.generate(["Hello"], sampling=SamplingParams(max_tokens=1, temperature=0))
    first = time.perf_counter()
    times = {"import": imported - started, "load": loaded - imported, "first_token": first - loaded}
    info = llm.engine.describe()
    print(json.dumps({"s": times, "dtype": str(llm.engine.dtype).removeprefix("torch."),
                      "weights": info.model.weight_format,
                      "invariant": info.batch_invariant_reason}))  # fmt: skip


def fresh_process(args) -> dict:
    cmd = [sys.executable, __file__, "--child", f"--dtype={args.dtype}"]
    cmd.append(f"--threads={args.threads}")
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def header_times(rounds: int, reader: bool) -> dict[str, list[float]]:
    """Seconds per read of the default model's header: ours, and gguf.GGUFReader's."""
    from punica_x.models import gguf_header
    from punica_x.models.loader import default_model_path

    path = default_model_path()
    times: dict[str, list[float]] = {"header (gguf_header)": []}
    if reader:
        times["header (gguf.GGUFReader)"] = []
    for _ in range(rounds):
        t = time.perf_counter()
        gguf_header.clear_cache()  # a read, not the cached header of the round before
        gguf_header.read_header(path)
        times["header (gguf_header)"].append(time.perf_counter() - t)
        if reader:
            from gguf import GGUFReader

            t = time.perf_counter()
            GGUFReader(str(path))
            times["header (gguf.GGUFReader)"].append(time.perf_counter() - t)
    return times


def row(phase: str, seconds: list[float]) -> dict:
    return {"phase": phase, "median_s": statistics.median(seconds), "min_s": min(seconds),
            "max_s": max(seconds), "rounds": len(seconds)}  # fmt: skip


def main() -> None:
    ap = parser(__doc__)
    add_rounds(ap, 5)
    add_dtype(ap)
    add_threads(ap)
    ap.add_argument("--no-reader", action="store_true", help="leave gguf.GGUFReader out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds < 1 or args.threads < 1:
        ap.error("--rounds and --threads must be at least 1")
    if args.child:
        child(args)
        return
    print(describe_machine(), flush=True)
    runs = [fresh_process(args) for _ in range(args.rounds)]
    rows = [row(p, [r["s"][p] for r in runs]) for p in PHASES]
    rows.append(row("process total", [sum(r["s"].values()) for r in runs]))
    rows += [row(p, s) for p, s in header_times(args.rounds, not args.no_reader).items()]
    summary = {k: runs[0][k] for k in ("dtype", "weights", "invariant")}
    title = f"start-up of the default model ({summary['dtype']}, {summary['weights']} weights)"
    print_table(rows, ["phase", "median_s", "min_s", "max_s", "rounds"], title)
    path = write_json("bench_startup", {"args": vars(args), "summary": summary, "rows": rows})
    plot(rows, title)
    print(f"wrote {path}")


def plot(rows: list[dict], title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["phase"] for r in rows], [r["median_s"] for r in rows])
    ax.set_xlabel("seconds (median)")
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    save_plot("bench_startup", fig)


if __name__ == "__main__":
    main()
