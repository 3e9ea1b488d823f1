"""What every benchmark reports: the machine it ran on, tables and timestamped progress lines
on stdout, and JSON and PNG files in benchmarks/results/<group>/ (one folder per kind of
machine; $PUNICA_X_RESULTS moves the whole tree elsewhere).

A run that writes JSON also regenerates its section of that folder's README.md when it
exits: the tables it printed, the command that made them and the machine, between
`<!-- generated: NAME -->` and `<!-- end: NAME -->` (NAME: the first JSON it wrote), in place
of the previous run's; the hand-written text around the sections stays."""

from __future__ import annotations

import atexit
import datetime
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parents[1]
# this run's printed tables (title, columns, cells) and the JSON names it wrote, by group
_RUN: dict = {"tables": [], "written": {}}


def machine() -> dict:
    """The CPU (model, SIMD flags, the ISA the kernels are built for), cores, torch, GPU."""
    from punica_x.ops import isa

    simd = [
        f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in isa.cpu_flags()
    ]
    info = {
        "cpu": isa.cpu_model(),
        "cpu_simd": simd,
        "isa": isa.resolve(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def describe_machine() -> str:
    """One line naming the CPU and ISA, printed first by every benchmark."""
    m = machine()
    line = (
        f"CPU: {m['cpu']} ({', '.join(m['cpu_simd']) or 'no AVX2'}; kernels built for "
        f"{m['isa']}), {m['cores']} cores, torch {m['torch']}, {m['threads']} threads"
    )
    return line + (f"; GPU: {m['gpu']}" if "gpu" in m else "")


def print_table(rows: Sequence[dict], columns: Sequence[str], title: str = "") -> None:
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    _RUN["tables"].append((title, list(columns), cells))
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    if title:
        print(f"\n{title}")
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def log(text: str) -> None:
    """A progress line stamped with the wall-clock time, flushed at once."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def results_dir(group: str | None = None) -> Path:
    """benchmarks/results/<group>: one folder per kind of machine, so figures from an AVX2
    and an AVX-512 CPU never overwrite each other. group: None = the ISA the CPU kernels
    are built for (avx2, avx512, avx512_bf16, generic), with `_on_<level>` when that is not
    the best level this CPU runs (an avx2 build measured on an AVX-512 CPU:
    avx2_on_avx512_bf16); "cuda" for GPU runs."""
    path = results_root() / (group or isa_group())
    path.mkdir(parents=True, exist_ok=True)
    return path


def results_root() -> Path:
    """$PUNICA_X_RESULTS when set (read at each call, so a test that sets it after this
    module was imported still keeps its files out of the repository), else
    benchmarks/results."""
    return Path(os.environ.get("PUNICA_X_RESULTS") or _HERE / "results")


def isa_group() -> str:
    from punica_x.ops import isa

    built, best = isa.resolve(), isa.native()
    return built if built == best else f"{built}_on_{best}"


def write_json(name: str, payload: dict, group: str | None = None) -> Path:
    folder = results_dir(group)
    path = folder / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    if not _RUN["written"]:
        atexit.register(update_readmes)
    written = _RUN["written"].setdefault(folder, [])
    if name not in written:  # a run may rewrite its JSON as it goes
        written.append(name)
    return path


def update_readmes() -> None:
    """Put this run's tables in the README of every results folder it wrote JSON to."""
    for folder, names in _RUN["written"].items():
        readme = folder / "README.md"
        text = readme.read_text(encoding="utf-8") if readme.exists() else ""
        readme.write_text(replace_section(text, names[0], render_section(names)))


def render_section(names: Sequence[str]) -> str:
    """This run as markdown: the command, the machine and date, its tables, its files."""
    command = shlex.join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    lines = [
        f"### {names[0]} (generated)",
        "",
        f"`{command}` on {describe_machine()}, {datetime.date.today().isoformat()}; "
        f"files: {', '.join(f'`{n}.json`' for n in names)}.",
    ]
    for title, columns, cells in _RUN["tables"]:
        lines += ["", f"{title}:", ""] if title else [""]
        lines.append("| " + " | ".join(columns) + " |")
        lines.append("|" + "---|" * len(columns))
        lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines) + "\n"


def replace_section(text: str, name: str, section: str) -> str:
    """`text` with the generated section NAME replaced by `section` (appended if absent)."""
    start, end = f"<!-- generated: {name} -->", f"<!-- end: {name} -->"
    block = f"{start}\n{section}{end}\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        return head + block + rest.split(end, 1)[1].lstrip("\n")
    return text.rstrip("\n") + ("\n\n" if text else "") + block


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display); imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(name: str, fig, group: str | None = None) -> Path:
    path = results_dir(group) / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path
