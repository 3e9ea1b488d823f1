"""How much host work does a decode step cost, and does it add to the device's time or hide
behind it? (issue 72: the host path)

A simulated device (ModelConfig.simulated_step_ms, punica_x/models/simulated.py) stands in for
the model: each forward holds --step-ms of wall time without the interpreter lock, as a GPU's
step does; everything else is the real engine: scheduling, LoRA plans for --adapters rank-16
adapters (round robin over the requests), greedy sampling orchestration, stop checks,
detokenization, outputs. The model behind it is a random Llama of vocab 1024, hidden 64, 2 layers
with SmolLM2's tokenizer (shape host-tiny), so the simulated tokens are real BPE text.

For each batch size B: B requests, each --max-tokens tokens (eos ignored), decoding together.
Per decode step (every request decoding): step wall time, the device time the step waited on
(the simulated forward's own time), host work = wall - wait, host work per request, and
step / max(T, host). Issue 72's targets, T = 5 ms: step <= 1.1 x max(T, host) at every B and host
<= 10 us per request at 256.

--overlap on|off|both: the engine's overlapped scheduling (EngineConfig.overlap; auto is on
with the simulated device); both measures each batch size both ways, side by side.

--server: the same batches through `punica-x serve --simulated-step-ms T` (HTTP, SSE), B
concurrent streams from this process (the minimal SSE client of bench_serve), one completion
each: delivered tokens/s beside the offline engine's at the same batch (issue 72: >= 0.9x).

    python benchmarks/bench_host.py [--step-ms 5] [--batches 1,32,128,256,512] [--max-tokens 128]
                                    [--adapters 8] [--rank 16]
"""

from __future__ import annotations

import statistics
import time

from common.args import add_adapters, add_max_tokens, add_rank, batch_sizes, parser
from common.report import describe_machine, log, print_table, pyplot, save_plot, write_json
from common.scratch import scratch_dir
from common.shapes import random_model
from common.workload import make_adapters, make_prompts

from punica_x import LLM, SamplingParams
from punica_x.models.simulated import FIRST_TOKEN

SHAPE = "host-tiny"
VOCAB = 1024  # the shape's vocabulary


def engine_for(
    model: str, batch: int, step_ms: float, adapters: list, max_tokens: int, overlap: str = "auto"
) -> LLM:
    """An engine on the simulated device with room for `batch` requests of a chat prompt and
    max_tokens generated tokens each."""
    blocks_each = (160 + max_tokens) // 16 + 2
    llm = LLM(
        model,
        dtype="float32",
        overlap=overlap,
        simulated_step_ms=step_ms,
        max_batch_size=batch,
        max_batched_tokens=max(2048, 160 * min(batch, 64)),
        num_blocks=batch * blocks_each + 64,
        max_lora_rank=16,
    )
    for i, path in enumerate(adapters):
        llm.load_adapter(f"a{i}", str(path))
    return llm


def prompt_ids(tokenizer, n: int) -> list[list[int]]:
    """n chat prompts as token ids inside the model's 1,024 (SmolLM2's ids above fold into
    the range: the simulated device reads a prompt's length, not its meaning)."""
    ids = [tokenizer.encode(p) for p in make_prompts(tokenizer, n)]
    return [[t if t < VOCAB else FIRST_TOKEN + t % (VOCAB - FIRST_TOKEN) for t in p] for p in ids]


def measure(llm: LLM, batch: int, n_adapters: int, max_tokens: int) -> dict:
    """B requests decoding together: the medians of the steps in which all of them decode."""
    engine, sim = llm.engine, llm.engine.forward
    waits = engine.overlap or sim  # what the step thread waits on: the device's samples
    prompts = prompt_ids(llm.tokenizer, batch)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        adapter = f"a{i % n_adapters}" if n_adapters else None
        engine.add_request(prompt, sp, adapter, cache_salt=f"host-{i}")
    walls, hosts, tokens = [], [], 0
    started = time.perf_counter()
    while engine.has_unfinished():
        decoding = (
            all(
                r.output_token_ids and r.num_computed_tokens == r.num_tokens - 1
                for r in engine.requests.values()
            )
            and len(engine.requests) == batch
        )
        waited0, t0 = waits.waited_s, time.perf_counter()
        outs = engine.step()
        wall = time.perf_counter() - t0
        tokens += sum(len(o.new_token_ids) for o in outs)
        if decoding:
            walls.append(wall)
            hosts.append(wall - (waits.waited_s - waited0))
    elapsed = time.perf_counter() - started
    wall, host = statistics.median(walls), statistics.median(hosts)
    step_s = sim.step_s
    return {
        "batch": batch,
        "decode_steps": len(walls),
        "step_ms": wall * 1e3,
        "device_ms": step_s * 1e3,
        "host_ms": host * 1e3,
        "host_us_per_req": host * 1e6 / batch,
        "step_over_bound": wall / max(step_s, host),
        "tok_s": tokens / elapsed,
    }


def through_server(
    args, model: str, adapters: list, batch: int, mode: str, backend: str, interval: int
) -> dict:
    """Delivered tokens/s of `batch` concurrent streams through punica-x serve on the same
    simulated device (one completion each, the prompts and adapters of measure), its runner
    on `backend` (thread: the engine steps in the server's process; process: in its own),
    streaming every `interval` tokens (serve --stream-interval); with the time until every
    stream had its first tokens and the tokens per SSE event."""
    import asyncio
    import contextlib

    from common.lean_client import run_lean_clients
    from common.server import bench_server
    from common.stream_clients import stream_body
    from transformers import AutoTokenizer

    prompts = prompt_ids(AutoTokenizer.from_pretrained(model), batch)
    extra = ("--model", model, "--simulated-step-ms", str(args.step_ms), "--dtype", "float32")
    extra += ("--max-batch-size", str(batch), "--overlap", mode, "--runner-backend", backend)
    extra += ("--stream-interval", str(interval))
    with contextlib.ExitStack() as stack:
        tmp = scratch_dir("bench-host-server-")
        _, url, key, _ = stack.enter_context(bench_server(tmp, adapters, extra))
        models = [f"a{i % len(adapters)}" if adapters else "base" for i in range(batch)]
        bodies = [stream_body(m, p, args.max_tokens, usage=True) for m, p in zip(models, prompts)]
        # warm-up: one stream per adapter, as the offline engine's (each adapter's first
        # load on the device is not what this measures)
        n_warm = max(4, len(adapters))
        warm = [
            stream_body(
                f"a{i % len(adapters)}" if adapters else "base", prompts[i % batch], 4, usage=True
            )
            for i in range(n_warm)
        ]
        asyncio.run(run_lean_clients(url, key, warm, n_warm))
        seconds, tokens, reads = asyncio.run(run_lean_clients(url, key, bodies, batch))
    if tokens != batch * args.max_tokens:
        raise RuntimeError(f"the server generated {tokens} tokens, {batch * args.max_tokens} asked")
    start = min(r.sent for r in reads)
    return {
        "tok_s": tokens / seconds,
        # until every stream had its first tokens: admission (HTTP, tokenization, placement)
        "all_started_ms": (max(r.first for r in reads) - start) * 1e3,
        # per SSE event, the finish, usage and [DONE] events included
        "tokens_per_event": tokens / sum(r.events for r in reads),
    }


def plot(rows: list[dict], step_ms: float, name: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for mode in sorted({r["overlap"] for r in rows}):
        mine = [r for r in rows if r["overlap"] == mode]
        b = [r["batch"] for r in mine]
        ax.plot(b, [r["step_ms"] for r in mine], "o-", label=f"step wall, overlap {mode}")
        ax.plot(b, [r["host_ms"] for r in mine], "s:", label=f"host work, overlap {mode}")
    ax.axhline(step_ms, color="grey", lw=0.8, label="T")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("requests decoding")
    ax.set_ylabel("ms per step")
    ax.set_title(f"decode step on a simulated {step_ms:g} ms device")
    ax.legend()
    save_plot(name, fig)


def parse_args():
    """The flags; bad values exit 2 naming the flag."""
    ap = parser(__doc__)
    ap.add_argument("--step-ms", type=float, default=5.0, help="the simulated device's step (T)")
    ap.add_argument("--batches", default="1,32,128,256,512")
    add_max_tokens(ap, default=128)
    add_adapters(ap, default=8)
    add_rank(ap)
    ap.add_argument("--overlap", choices=["auto", "on", "off", "both"], default="auto")
    ap.add_argument("--server", action="store_true", help="also through the HTTP server")
    ap.add_argument(
        "--runner-backends",
        default="thread,process",
        help="with --server: the runner backends to serve from (thread, process)",
    )
    ap.add_argument(
        "--stream-intervals",
        default="1",
        help="with --server: serve --stream-interval values to serve with (e.g. 1,4)",
    )
    ap.add_argument("--name", default="bench_host")
    args = ap.parse_args()
    args.batch_sizes = batch_sizes(ap, args.batches)
    args.backends = [b.strip() for b in args.runner_backends.split(",")]
    if not args.backends or not set(args.backends) <= {"thread", "process"}:
        ap.error(f"--runner-backends wants thread and/or process, got {args.runner_backends!r}")
    try:
        args.intervals = [int(n) for n in args.stream_intervals.split(",")]
    except ValueError:
        ap.error(f"--stream-intervals wants integers, got {args.stream_intervals!r}")
    if not all(1 <= n <= 4096 for n in args.intervals):
        ap.error(f"--stream-intervals wants integers in 1..4096, got {args.stream_intervals!r}")
    if not 0 < args.step_ms <= 1000:  # nan too
        ap.error(f"--step-ms must be in (0, 1000], got {args.step_ms}")
    if not 0 < args.max_tokens <= 4096 or not 0 <= args.adapters <= 64 or args.rank <= 0:
        ap.error("--max-tokens wants 1..4096, --adapters 0..64, --rank > 0")
    return args


def server_rows(args, model: str, adapters: list, row: dict, mode: str) -> list[dict]:
    """The offline `row`'s batch through the server, from each backend and stream interval."""
    out = []
    for backend in args.backends:
        for interval in args.intervals:
            served = through_server(args, model, adapters, row["batch"], mode, backend, interval)
            out.append(
                {
                    "overlap": row["overlap"],
                    "batch": row["batch"],
                    "backend": backend,
                    "stream_interval": interval,
                    "server_tok_s": served["tok_s"],
                    "x_offline": served["tok_s"] / row["tok_s"],
                    "all_started_ms": served["all_started_ms"],
                    "tokens_per_event": served["tokens_per_event"],
                }
            )
    return out


def main() -> None:
    args = parse_args()
    batches = args.batch_sizes
    print(describe_machine(), flush=True)
    model = str(random_model(SHAPE))
    adapters = make_adapters(model, args.adapters, args.rank, scratch_dir("bench-host-"))
    modes = ["off", "on"] if args.overlap == "both" else [args.overlap]
    rows, served = [], []
    for batch in batches:
        for mode in modes:
            log(f"batch {batch}, overlap {mode}")
            llm = engine_for(model, batch, args.step_ms, adapters, args.max_tokens, mode)
            measure(llm, min(batch, 8), args.adapters, 8)  # warm-up: first calls, allocations
            llm.engine.forward.reset()
            row = {"overlap": "on" if llm.engine.overlap else "off"}
            row |= measure(llm, batch, args.adapters, args.max_tokens)
            rows.append(row)
            llm.engine.shutdown()
            if args.server:
                served += server_rows(args, model, adapters, row, mode)
    columns = [
        "overlap",
        "batch",
        "decode_steps",
        "step_ms",
        "device_ms",
        "host_ms",
        "host_us_per_req",
        "step_over_bound",
        "tok_s",
    ]
    title = (
        f"decode step on the simulated device (T = {args.step_ms:g} ms), {args.adapters} "
        f"rank-{args.rank} adapters, greedy, {args.max_tokens} tokens"
    )
    print_table(rows, columns, title)
    if served:
        title = f"the same batches through the server, {args.max_tokens} tokens a stream"
        print_table(served, list(served[0]), title)
    write_json(args.name, {"args": vars(args), "rows": rows, "server_rows": served})
    plot(rows, args.step_ms, args.name)


if __name__ == "__main__":
    main()
