"""What do repeated runs of a benchmark give, as median and range? Reads the JSON records of
N runs of one benchmark whose records hold per-workload `rows` (bench_generate.py), each
kept beside it as its raw record, and writes each figure's median, min and max over the runs:
a table, <name>.json and <name>.png. The runs must be of one machine (CPU, ISA, cores) and
one command; a record of another is refused.

    python benchmarks/repeat_summary.py NAME RUN.json RUN.json RUN.json [--group amx]
        [--columns ours_tok_s,vllm_tok_s,x_vllm,x_vllm_auto,x_hf_mixed]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common.report import describe_machine, print_table, pyplot, save_plot, write_json

COLUMNS = "ours_tok_s,vllm_tok_s,x_vllm,x_vllm_auto,x_hf_mixed"


def load_runs(paths: list[Path]) -> list[dict]:
    """The records, refused (SystemExit) unless of one machine and one command."""
    runs = [json.loads(p.read_text()) for p in paths]
    first = runs[0]
    for path, run in zip(paths, runs):
        if run["machine"] != first["machine"] or run.get("args") != first.get("args"):
            raise SystemExit(f"{path}: another machine or command than {paths[0]}")
    return runs


def spread(runs: list[dict], columns: list[str]) -> list[dict]:
    """Per workload, each column's 'median [min-max]' cell and its numbers."""
    out = []
    for i, row in enumerate(runs[0]["rows"]):
        cell = {"workload": row["workload"]}
        for c in columns:
            values = [r["rows"][i].get(c) for r in runs]
            if any(v is None for v in values):
                continue
            med, low, high = statistics.median(values), min(values), max(values)
            cell[c] = f"{med:.2f} [{low:.2f}-{high:.2f}]"
            cell[f"{c}_runs"] = values
        out.append(cell)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name")
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--group", default=None, help="results folder (default: this machine's)")
    ap.add_argument("--columns", default=COLUMNS)
    args = ap.parse_args()
    if len(args.runs) < 3:
        ap.error("at least 3 runs")
    columns = args.columns.split(",")
    runs = load_runs(args.runs)
    rows = spread(runs, columns)
    print(describe_machine())
    shown = [c for c in columns if any(c in r for r in rows)]
    title = f"median [range] over {len(runs)} runs ({', '.join(p.name for p in args.runs)})"
    print_table(rows, ["workload", *shown], title)
    write_json(args.name, {"runs": [p.name for p in args.runs], "rows": rows}, args.group)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = [c for c in ("ours_tok_s", "vllm_tok_s") if c in shown]
    for k, c in enumerate(bars):
        meds = [statistics.median(r[f"{c}_runs"]) for r in rows]
        err = [[m - min(r[f"{c}_runs"]) for m, r in zip(meds, rows)],
               [max(r[f"{c}_runs"]) - m for m, r in zip(meds, rows)]]  # fmt: skip
        xs = [i + 0.4 * k for i in range(len(rows))]
        ax.bar(xs, meds, 0.4, yerr=err, capsize=3, label=c)
    ax.set_xticks([i + 0.2 for i in range(len(rows))], [r["workload"] for r in rows])
    ax.set_ylabel("tokens/s (median, range)")
    ax.legend()
    save_plot(args.name, fig, args.group)


if __name__ == "__main__":
    main()
