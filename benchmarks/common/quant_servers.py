"""bench_quant's servers: punica-x and llama.cpp's server on the same GGUF files, the same
requests through each one's OpenAI completions route (see bench_quant.py's docstring)."""

from __future__ import annotations

import functools

import httpx

from common import llama_cpp
from common.http_load import tokens_per_second
from common.report import machine, print_table, pyplot, save_plot, write_json
from common.scratch import scratch_dir
from common.server import bench_server, free_port
from common.workload import make_adapters, make_prompts, random_adapters, workload_names
from punica_x.models.loader import convert_gguf, default_model_path

X8 = ("--quant-activations", "int8")  # llama.cpp's arithmetic; the default is int16
# adapters stored in bfloat16 under a float32 model (no-op where bfloat16 is served anyway)
LORA16 = ("--lora-dtype", "bfloat16")
# (label ending in the llama.cpp file it is measured against, server, file, punica-x options)
SERVERS = [
    ("punica-x Q4_1", "punica-x", "Q4_1", ("--quantization", "auto")),
    ("punica-x x:int8 Q4_1", "punica-x", "Q4_1", ("--quantization", "auto", *X8)),
    (
        "punica-x x:int8 lora:bf16 Q4_1",
        "punica-x",
        "Q4_1",
        ("--quantization", "auto", *X8, *LORA16),
    ),
    ("punica-x Q8_0", "punica-x", "Q8_0", ("--quantization", "auto")),
    ("punica-x bf16", "punica-x", "Q4_1", ("--quantization", "none", "--dtype", "bfloat16")),
    ("llama.cpp Q4_1", "llama.cpp", "Q4_1", ()),
    ("llama.cpp Q8_0", "llama.cpp", "Q8_0", ()),
    ("llama.cpp bf16", "llama.cpp", "bf16", ()),
]
WORKLOADS = ("one_stream", "backbone", "identical", "distinct")


def gguf_files(hf_dir) -> dict:
    """The three files: the default Q4_1, and bf16 / Q8_0 made from its dequantized weights
    by llama.cpp's tools (cached beside its build)."""
    root = llama_cpp.cache_root() / "files"
    root.mkdir(exist_ok=True)
    bf16 = llama_cpp.convert_base(hf_dir, root / "SmolLM2-135M-Instruct.bf16.gguf", "bf16")
    q8 = llama_cpp.quantize(bf16, root / "SmolLM2-135M-Instruct.Q8_0.gguf", "Q8_0")
    return {"Q4_1": default_model_path(), "Q8_0": q8, "bf16": bf16}


def tensor_bytes(path) -> int:
    from punica_x.models import gguf_header

    return sum(gguf_header.nbytes(t) for t in gguf_header.read_header(path).tensors)


# --model SHAPE: a random-weight model of that shape in Q4_0 (llama-quantize), both servers
SHAPE_SERVERS = [
    ("punica-x Q4_0", "punica-x", "Q4_0", ("--quantization", "auto")),
    ("punica-x x:int8 Q4_0", "punica-x", "Q4_0", ("--quantization", "auto", *X8)),
    (
        "punica-x x:int8 lora:bf16 Q4_0",
        "punica-x",
        "Q4_0",
        ("--quantization", "auto", *X8, *LORA16),
    ),
    ("llama.cpp Q4_0", "llama.cpp", "Q4_0", ()),
]


def shape_files(shape: str) -> tuple:
    """(HF folder, {"Q4_0": file}) of a random model of `shape` (common.shapes): its bf16
    GGUF by llama.cpp's converter, quantized by llama-quantize (all cached)."""
    from common.shapes import random_model

    hf_dir = random_model(shape)
    root = llama_cpp.cache_root() / "files"
    root.mkdir(exist_ok=True)
    bf16 = llama_cpp.convert_base(hf_dir, root / f"random-{shape}.bf16.gguf", "bf16")
    return hf_dir, {"Q4_0": llama_cpp.quantize(bf16, root / f"random-{shape}.Q4_0.gguf", "Q4_0")}


def servers(args) -> None:
    tmp = scratch_dir("bench-quant-serve-")
    from transformers import AutoTokenizer

    n = args.requests
    if args.model:
        hf_dir, files = shape_files(args.model)
        paths = random_adapters(hf_dir, n, args.rank, tmp / "adapters")
        servers_, lora_type = SHAPE_SERVERS, "bf16"
    else:
        hf_dir = convert_gguf(default_model_path())
        files = gguf_files(hf_dir)
        paths = make_adapters(hf_dir, n, args.rank, tmp / "adapters")
        servers_, lora_type = SERVERS, "f32"
    prompts = make_prompts(AutoTokenizer.from_pretrained(hf_dir), n)
    loras = [
        llama_cpp.convert_lora(p, hf_dir, tmp / f"a{i}.gguf", lora_type)
        for i, p in enumerate(paths)
    ]
    rows = []
    for label, kind, fmt, opts in pick(servers_, args.servers):
        print(f"{label} ...", flush=True)
        run = run_punica if kind == "punica-x" else run_llama_cpp
        row = {"server": label, "file": fmt, **run(args, files[fmt], opts, prompts, paths, loras)}
        row["x_file_bytes"] = row["weights_MB"] * 1e6 / tensor_bytes(files[fmt])
        rows.append(row)
        print({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    report(args, rows)


def pick(servers_: list, labels: str | None) -> list:
    """The servers whose labels are in the comma-separated `labels` (None: all), in table
    order; SystemExit naming the choices for an unknown label."""
    if labels is None:
        return servers_
    wanted = {w.strip() for w in labels.split(",") if w.strip()}
    known = {s[0] for s in servers_}
    if not wanted or wanted - known:
        unknown = sorted(wanted - known)
        raise SystemExit(f"--servers: unknown {unknown}; choose from {sorted(known)}")
    return [s for s in servers_ if s[0] in wanted]


def _jobs(model_of, prompts, extra_of) -> dict:
    """Per workload, the (model, prompt, extra body) of each request."""
    n = len(prompts)
    distinct = [int(a[1:]) for a in workload_names(n)["distinct"]]
    return {
        "one_stream": [(model_of(None), prompts[0], extra_of(None))],
        "backbone": [(model_of(None), p, extra_of(None)) for p in prompts],
        "identical": [(model_of(0), p, extra_of(0)) for p in prompts],
        "distinct": [(model_of(a), p, extra_of(a)) for a, p in zip(distinct, prompts)],
    }


def _measure(args, url, key, jobs: dict, which=WORKLOADS) -> dict:
    out = {}
    for w in which:
        tokens = args.stream_tokens if w == "one_stream" else args.max_tokens
        tokens_per_second(url, key, jobs[w][:2], 2, 4)  # warm-up
        out[w + "_tok_s"] = tokens_per_second(url, key, jobs[w], len(jobs[w]), tokens)
    return out


def run_punica(args, path, opts, prompts, paths, loras) -> dict:
    extra = ("--model", str(path), *opts)
    tmp = scratch_dir("bench-quant-px-")
    with bench_server(tmp, paths, extra, args.threads) as (_, url, key, base):
        jobs = _jobs(lambda a: base if a is None else f"a{a}", prompts, lambda a: {})
        row = _measure(args, url, key, jobs)
        auth = {"Authorization": f"Bearer {key}"}
        model = httpx.get(url + "/v1/models", headers=auth).json()["data"][0]
    return {**row, "weights": model.get("weight_format"), "weights_MB": model["weight_bytes"] / 1e6}


def run_llama_cpp(args, path, opts, prompts, paths, loras) -> dict:
    row = {}
    tmp = scratch_dir("bench-quant-lc-")
    for with_loras, which in ((False, WORKLOADS[:2]), (True, WORKLOADS[2:])):
        port = free_port()
        adapters = loras if with_loras else []
        log = tmp / f"server-{with_loras}.log"
        proc = llama_cpp.start_server(path, port, args.threads, len(prompts), adapters, log)
        try:
            url = f"http://127.0.0.1:{port}"
            body = functools.partial(llama_cpp.lora_body, adapters=len(adapters))
            row |= _measure(args, url, "", _jobs(lambda a: "x", prompts, body), which)
        finally:
            proc.terminate()
            proc.wait(30)
    return {**row, "weights": path.suffix, "weights_MB": tensor_bytes(path) / 1e6}


def report(args, rows: list[dict]) -> None:
    by = {r["server"]: r for r in rows}
    model = args.model or "SmolLM2-135M-Instruct"
    peers = [r for r in rows if r["server"].startswith("llama.cpp")]
    # llama.cpp's fastest format on this CPU (of those run: --servers may leave some out)
    fastest = max(peers, key=_backbone) if peers else None
    for r in rows:
        peer = by.get("llama.cpp " + r["server"].split()[-1])
        if not r["server"].startswith("punica-x") or peer is None:
            continue
        for w in WORKLOADS:
            r["x_" + w] = r[w + "_tok_s"] / peer[w + "_tok_s"]
        r["x_backbone_vs_fastest"] = _backbone(r) / _backbone(fastest)
    print(
        f"{model}, {args.requests} requests x {args.max_tokens} tokens, one "
        f"stream x {args.stream_tokens}, rank {args.rank} on all 7 projections, "
        f"{args.threads} threads per server; x_: punica-x over llama.cpp on the same file "
        f"(backbone_vs_fastest: over {fastest['server'] if fastest else 'none run'})"
    )
    cols = ["server", *[w + "_tok_s" for w in WORKLOADS], "weights_MB", "x_file_bytes"]
    print_table(rows, cols, "tokens/s through the OpenAI completions route")
    xs = ["server", *["x_" + w for w in WORKLOADS], "x_backbone_vs_fastest"]
    print_table([r for r in rows if "x_backbone" in r], xs, "punica-x / llama.cpp, same file")
    name = "bench_quant_serve" + (f"_{args.model.replace('.', '_')}" if args.model else "")
    path = write_json(name, {"args": vars(args), "rows": rows})
    plot(rows, name)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def _backbone(r: dict) -> float:
    return r["backbone_tok_s"]


def plot(rows, name: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        xs = [x + (i - len(rows) / 2 + 0.5) * width for x in range(len(WORKLOADS))]
        ax.bar(xs, [r[w + "_tok_s"] for w in WORKLOADS], width, label=r["server"])
    ax.set_xticks(range(len(WORKLOADS)), ["one stream", "Backbone", "Identical", "Distinct"])
    ax.set_ylabel("generated tokens / s")
    m = machine()
    ax.set_title(f"GGUF files served: punica-x vs llama.cpp ({m['cpu']}, {m['isa']})")
    ax.legend(fontsize=8)
    save_plot(name, fig)
