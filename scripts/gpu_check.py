"""Every GPU check in one bounded command (scripts/gpu_check.sh runs this after installing the
carried wheels): build the kernels, run the GPU-marked tests, the 8B-shaped benchmark of one
runner and the server end to end; write what each step found and where each minute went.

A lent GPU machine comes for ~15 minutes with no network, so nothing here may hang or lose
what it measured: every step runs as its own process group under a timeout cut to what is
left of --budget-s (SIGTERM, then SIGKILL 15 s later; the benchmarks write their JSON as each
phase ends and again on SIGTERM), a step that fails does not stop the next, and the summary
is written after every step.

Steps: env (the GPU, torch, the carried packages), build (punica-x prepare: the host's CPU
kernels and sgmv_cuda), gpu_tests (pytest -m "gpu or triton", junit XML; the Triton
kernels' tests run on the GPU), host (bench_host_cuda.py: the 8B shape's decode step at 1, 32,
128 and 256 requests against its byte floor, GPU busy, overlapped eager steps beside graphs,
the profiler's top host costs), bench_generate (--device cuda,
the Llama-3-8B shape, 32 and 128 requests, CUDA graphs on and off), bench_sgmv (the SGMV
kernels alone over the adapter-popularity workloads, the split-K shrink beside the write-once
one), serve (punica-x serve on
the GPU through HTTP: bench_serve_cuda.py), invariance (bench_generate again with
--batch-invariant on: the mode's Triton kernels, their decode step over bench_generate's).

What it writes into --results (default: $OUT where the device tool sets it, else
./gpu_check_out): gpu_check.json (every step: status, seconds, the log's tail, the figures
it produced), gpu_check.md (the same as tables), results.tar.gz (the benchmarks' JSON, PNG
and the README of benchmarks/results/cuda with their generated sections: unpack it in
benchmarks/results),
logs.tar.gz (each step's whole log).

--dry-run: the same steps on the CPU at toy sizes (the GPU tests collected and skipped, the
benchmarks' GPU paths on a tiny model), for the suite: the plumbing, the timeouts and the
reports are what it checks, not a GPU."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAIL_LINES = 25
KILL_GRACE_S = 15
MIN_STEP_S = 10  # a step with less than this left of the budget is skipped, not started


@dataclass
class Step:
    """One check: argv run from the repo root with `env` added, at most timeout_s seconds."""

    name: str
    argv: list[str]
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class StepResult:
    name: str
    status: str  # ok | failed | timeout | skipped
    seconds: float
    returncode: int | None
    command: str
    tail: list[str]
    figures: dict = field(default_factory=dict)


def run_step(step: Step, log: Path, seconds_left: float) -> StepResult:
    """Runs the step in a process group of its own; on its timeout (or the budget's, the
    smaller) SIGTERM to the group, SIGKILL KILL_GRACE_S later. Never raises for the step."""
    command = " ".join(step.argv)
    limit = min(step.timeout_s, seconds_left)
    if seconds_left < MIN_STEP_S:
        return StepResult(step.name, "skipped", 0.0, None, command, ["budget spent"])
    start = time.monotonic()
    with log.open("w") as out:
        out.write(f"$ {command}\n")
        out.flush()
        try:
            proc = subprocess.Popen(
                step.argv,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **step.env},
                start_new_session=True,
            )
        except OSError as exc:
            return StepResult(step.name, "failed", 0.0, None, command, [str(exc)])
        status = "ok"
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            status = "timeout"
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
    if status == "ok" and proc.returncode != 0:
        status = "failed"
    tail = log.read_text(errors="replace").splitlines()[-TAIL_LINES:]
    return StepResult(step.name, status, time.monotonic() - start, proc.returncode, command, tail)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def junit_counts(path: Path) -> dict:
    """{tests, passed, failures, errors, skipped, failed_names} of a pytest junit XML file
    ({} when there is none: the run never got that far)."""
    if not path.exists():
        return {}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        return {"error": f"junit XML unreadable: {exc}"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors")}
    counts["skipped"] = sum(int(s.get("skipped", 0)) for s in suites)
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    counts["failed_names"] = failed
    return counts


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def steps_for(args, work: Path) -> list[Step]:
    """The checks in order; --dry-run swaps each GPU-sized command for its CPU toy."""
    py = sys.executable
    results_env = {"PUNICA_X_RESULTS": str(work / "results")}
    # a tokenizer folder serves the random models of a shape, never a model folder of its own
    tok = ["--tokenizer", args.tokenizer] if args.tokenizer and not args.dry_model else []
    env_probe = (
        "import importlib, json, torch\n"
        "mods = ['starlette', 'uvicorn', 'pydantic', 'websockets', 'llguidance', 'gguf', "
        "'peft', 'transformers', 'flashinfer', 'ray']\n"
        "found = {m: importlib.util.find_spec(m) is not None for m in mods}\n"
        "gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None\n"
        "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
        "'gpu': gpu, 'modules': found}))\n"
    )
    junit = work / "junit.xml"
    pytest_argv = [py, "-m", "pytest", "-m", "gpu or triton", "-q", "-p", "no:cacheprovider"]
    pytest_argv += ["-rfEs"]  # failures, errors and every skip with its reason
    pytest_argv += ["--junitxml", str(junit), "--continue-on-collection-errors"]
    if importlib.util.find_spec("pytest_timeout") is not None:  # one hung test, not the step
        pytest_argv += ["--timeout", str(int(args.test_timeout_s))]
    if args.dry_run:
        model = ["--model", args.dry_model] if args.dry_model else []
        bench = [py, "benchmarks/bench_generate.py", "--device", "cpu", "--dry-run", *model]
        bench += ["--gpu-requests", "4", "--max-tokens", "4", "--rounds", "1"]
        bench += ["--decode-steps", "2", "--hf-workloads", "uniform", *tok]
        serve = [py, "benchmarks/bench_serve_cuda.py", "--device", "cpu", *model, *tok]
        serve += ["--adapters", "2", "--requests", "4", "--clients", "2", "--max-tokens", "4"]
        tests = [*pytest_argv, "tests/punica_x/test_engine_cuda.py"]
        sgmv = [py, "benchmarks/bench_sgmv.py", "--device", "cpu", "--repeats", "1"]
        host = [py, "benchmarks/bench_host_cuda.py", "--device", "cpu", "--dry-run", *model]
        host += ["--batches", "1,4", "--max-tokens", "16", "--steps", "4", "--adapters", "2"]
    else:
        bench = [py, "benchmarks/bench_generate.py", "--device", "cuda", "--model", "llama-3-8b"]
        bench += ["--gpu-requests", args.gpu_requests, "--rounds", "2", "--decode-steps", "8"]
        bench += ["--attention-backend", args.attention_backend, "--hf-workloads", args.hf, *tok]
        serve = [py, "benchmarks/bench_serve_cuda.py", "--device", "cuda", "--model"]
        serve += ["llama-3-8b", *tok]
        tests = [*pytest_argv, *gpu_test_files()]
        sgmv = [py, "benchmarks/bench_sgmv.py", "--device", "cuda", "--repeats", "20"]
        sgmv += ["--batches", args.sgmv_batches]
        host = [py, "benchmarks/bench_host_cuda.py", "--device", "cuda", *tok]
        host += ["--model", "llama-3-8b", "--batches", args.host_batches]
    return [
        Step("env", [py, "-c", env_probe], 60),
        Step("build", [py, "-m", "punica_x.prepare", "--no-model"], 360),
        Step("gpu_tests", tests, args.tests_timeout_s),
        Step("host", host, args.host_timeout_s, results_env),
        Step("bench_generate", bench, args.bench_timeout_s, results_env),
        Step("bench_sgmv", sgmv, args.sgmv_timeout_s, results_env),
        Step("serve", serve, args.serve_timeout_s, results_env),
        Step("invariance", [*bench, "--batch-invariant", "on"], args.bench_timeout_s, results_env),
    ]


def chosen_steps(steps: list[Step], only: str) -> list[Step]:
    """--only's steps in the order it names them (the step whose figures matter most can run
    first, before the budget is spent); ValueError naming the unknown or repeated ones."""
    names = only.split(",")
    by_name = {s.name: s for s in steps}
    unknown = sorted(set(names) - set(by_name))
    if unknown:
        raise ValueError(f"unknown steps {unknown} (known: {', '.join(by_name)})")
    if len(set(names)) != len(names):
        raise ValueError(f"a step named twice in --only {only!r}")
    return [by_name[n] for n in names]


def gpu_test_files() -> list[str]:
    """The test files with gpu-, triton- or device_pair-marked tests (the batch-invariant
    Triton kernels run on the GPU there): collecting the whole suite would import modules
    whose packages a lent machine lacks (ray, selenium, ...), and a collection error there
    would cost the GPU tests their run."""
    marks = ("pytest.mark.gpu", "pytest.mark.triton", "pytest.mark.device_pair")
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if any(m in p.read_text(errors="replace") for m in marks)
    )


def figures_of(result: StepResult, work: Path) -> dict:
    """What a finished step produced, read from its files (partial files too)."""
    results = work / "results"  # cuda/ on a GPU; a CPU run's ISA folder on a --dry-run
    if result.name == "env":
        for line in reversed(result.tail):
            if line.startswith("{"):
                return read_json_text(line)
    if result.name == "gpu_tests":
        return junit_counts(work / "junit.xml")
    if result.name in ("bench_generate", "invariance"):
        found = [
            p
            for p in sorted(results.glob("*/bench_generate_cuda_*.json"))
            if p.stem.endswith("_invariant_on") == (result.name == "invariance")
        ]
        data = read_json(found[-1]) if found else {}
        return {"summary": data.get("summary", {}), "rows": data.get("rows", [])}
    if result.name == "host":
        found = sorted(results.glob("*/bench_host_cuda*.json"))
        data = read_json(found[-1]) if found else {}
        return {"summary": data.get("summary", {}), "rows": data.get("rows", [])}
    if result.name == "bench_sgmv":
        found = sorted(results.glob("*/bench_sgmv*.json"))
        return {"rows": read_json(found[-1]).get("rows", [])} if found else {}
    if result.name == "serve":
        found = sorted(results.glob("*/bench_serve_cuda_*.json"))
        data = read_json(found[-1]) if found else {}
        return {"summary": data.get("summary", {})}
    return {}


def read_json_text(text: str) -> dict:
    try:
        return json.loads(text)
    except ValueError:
        return {}


def markdown(report: dict) -> str:
    """gpu_check.md: where the minutes went, then each step's figures as tables."""
    lines = [
        f"# gpu_check {report['mode']} ({report['started']})",
        "",
        f"Budget {report['budget_s']:.0f} s, used {report['used_s']:.0f} s.",
        "",
        "| step | status | seconds | minutes |",
        "|---|---|---|---|",
    ]
    for s in report["steps"]:
        lines.append(
            f"| {s['name']} | {s['status']} | {s['seconds']:.1f} | {s['seconds'] / 60:.2f} |"
        )
    for s in report["steps"]:
        figs = s.get("figures") or {}
        if s["name"] == "gpu_tests" and figs:
            lines += ["", "## GPU-marked tests", ""]
            lines.append(
                ", ".join(
                    f"{k} {figs.get(k)}"
                    for k in ("tests", "passed", "failures", "errors", "skipped")
                )
            )
            lines += [f"- failed: {n}" for n in figs.get("failed_names", [])]
        if s["name"] == "bench_generate" and figs.get("rows"):
            lines += ["", "## bench_generate", "", _table(figs["rows"])]
        if s["name"] == "host" and figs.get("rows"):
            summary = figs.get("summary", {})
            lines += ["", "## host (decode step vs its byte floor)", "", _table(figs["rows"])]
            lines += ["", f"copy bandwidth {summary.get('copy_GB_s', 0):.0f} GB/s"]
            if summary.get("top_host_costs"):
                lines += ["", "Top host costs a step", "", _table(summary["top_host_costs"])]
        if s["name"] == "bench_sgmv" and figs.get("rows"):
            lines += ["", "## bench_sgmv", "", _table(figs["rows"])]
        if s["name"] == "serve" and figs.get("summary"):
            lines += ["", "## serve", "", _table([_scalars(figs["summary"])])]
        if s["name"] == "invariance" and figs.get("rows"):
            lines += ["", "## invariance (batch_invariant=on)", "", _table(figs["rows"])]
            lines += _invariance_cost(report["steps"], figs["rows"])
        if s["status"] != "ok":
            lines += ["", f"### {s['name']}: {s['status']} (last lines)", "", "```"]
            lines += s["tail"][-10:] + ["```"]
    return "\n".join(lines) + "\n"


def _invariance_cost(steps: list[dict], on_rows: list[dict]) -> list[str]:
    """The mode's cost per workload: its decode step over bench_generate's (the mode off, the
    same shape and counts, an earlier step of the same run)."""
    off = next((s.get("figures") or {} for s in steps if s["name"] == "bench_generate"), {})
    base = {(r["requests"], r["workload"]): r for r in off.get("rows", []) if r.get("step_ms")}
    rows = [
        {
            "requests": r["requests"],
            "workload": r["workload"],
            "on_step_ms": r["step_ms"],
            "off_step_ms": base[key]["step_ms"],
            "cost": r["step_ms"] / base[key]["step_ms"] - 1,
        }
        for r in on_rows
        if r.get("step_ms") and (key := (r["requests"], r["workload"])) in base
    ]
    return (
        ["", "The mode's decode cost (its step over the default run's)", "", _table(rows)]
        if rows
        else []
    )


def _scalars(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str))}


def _table(rows: list[dict]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))

    def cell(v) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def write_outputs(report: dict, work: Path, results: Path) -> None:
    """gpu_check.json / .md, results.tar.gz (work/results: unpack in benchmarks/results) and
    logs.tar.gz in `results`."""
    results.mkdir(parents=True, exist_ok=True)
    (results / "gpu_check.json").write_text(json.dumps(report, indent=2))
    (results / "gpu_check.md").write_text(markdown(report))
    for name, folder in (("results", work / "results"), ("logs", work / "logs")):
        tmp = results / f".{name}.tar.gz"
        with tarfile.open(tmp, "w:gz") as tar:
            if folder.exists():
                tar.add(folder, arcname=".")
        tmp.replace(results / f"{name}.tar.gz")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="the plumbing on the CPU, toy sizes")
    ap.add_argument("--budget-s", type=float, default=480.0, help="all steps together")
    ap.add_argument("--results", default=os.environ.get("OUT") or "gpu_check_out")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for the random models")
    ap.add_argument("--dry-model", default=None, help="--dry-run: a model folder (tiny)")
    ap.add_argument("--gpu-requests", default="32", help="bench_generate's request counts")
    ap.add_argument("--attention-backend", default="torch")
    ap.add_argument("--hf", default="none", help="bench_generate --hf-workloads (none: no HF)")
    ap.add_argument("--tests-timeout-s", type=float, default=180.0)
    ap.add_argument("--test-timeout-s", type=float, default=90.0, help="one test (pytest-timeout)")
    ap.add_argument("--bench-timeout-s", type=float, default=240.0)
    ap.add_argument("--sgmv-timeout-s", type=float, default=120.0)
    ap.add_argument("--sgmv-batches", default="1,2,4,8,16,32,48,64,128,256,512")
    ap.add_argument("--serve-timeout-s", type=float, default=200.0)
    ap.add_argument("--host-timeout-s", type=float, default=300.0)
    ap.add_argument("--host-batches", default="1,32,128,256", help="bench_host_cuda's batches")
    ap.add_argument("--only", default=None, help="comma-separated steps to run, in that order")
    args = ap.parse_args(argv)
    if args.budget_s <= 0 or not args.budget_s < float("inf"):
        ap.error(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    try:
        batches = [int(b) for b in args.host_batches.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        ap.error(f"--host-batches wants positive integers, got {args.host_batches!r}")
    timeouts = ("tests_timeout_s", "test_timeout_s", "bench_timeout_s", "serve_timeout_s")
    for name in (*timeouts, "host_timeout_s"):
        value = getattr(args, name)
        if not 0 < value < float("inf"):
            ap.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    results = Path(args.results).resolve()
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    (work / "logs").mkdir()
    cuda = work / "results" / "cuda"
    cuda.mkdir(parents=True)
    readme = ROOT / "benchmarks" / "results" / "cuda" / "README.md"
    if readme.exists() and not args.dry_run:  # generated sections land in the real README
        shutil.copy(readme, cuda / "README.md")
    steps = steps_for(args, work)
    if args.only is not None:
        try:
            steps = chosen_steps(steps, args.only)
        except ValueError as exc:
            print(f"gpu_check: {exc}", file=sys.stderr)
            return 2
    start = time.monotonic()
    report = {
        "mode": "dry-run (CPU)" if args.dry_run else "GPU",
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "budget_s": args.budget_s,
        "used_s": 0.0,
        "steps": [],
    }
    for step in steps:
        left = args.budget_s - (time.monotonic() - start)
        print(f"[gpu_check] {step.name}: {' '.join(step.argv)[:160]}", flush=True)
        result = run_step(step, work / "logs" / f"{step.name}.log", left)
        result.figures = figures_of(result, work)
        report["steps"].append(asdict(result))
        report["used_s"] = time.monotonic() - start
        print(
            f"[gpu_check] {step.name}: {result.status} in {result.seconds:.1f} s "
            f"({report['used_s'] / 60:.1f} of {args.budget_s / 60:.1f} min)",
            flush=True,
        )
        if result.status != "ok":
            print("\n".join(result.tail[-8:]), flush=True)
        write_outputs(report, work, results)
    print("\n[gpu_check] where the minutes went:")
    for s in report["steps"]:
        print(f"  {s['name']:>15}  {s['status']:>8}  {s['seconds'] / 60:5.2f} min")
    print(f"[gpu_check] wrote {results}/gpu_check.json, gpu_check.md, results.tar.gz, logs.tar.gz")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(s["status"] == "ok" for s in report["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
