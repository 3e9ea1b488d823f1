"""DistKV: how long a context N runners serve together, and what decoding costs when part
of the KV lives on peers.

    python benchmarks/bench_distkv.py [--blocks 32] [--context 2048] [--decode 32]
                                      [--rounds 3] [--model PATH]
                                      [--batch-invariant auto|on|off|both]

1. Longest context: 1, 2 and 4 runners of --blocks KV blocks each (thread runners in one
   process sharing the weights, DistKV through scheduler/distkv/network.py). The longest prompt the
   cluster admits is run to completion; target >= 0.9 x N x the single-runner length.
2. Decode time per token of one greedy request holding --context tokens, with 0% (all
   local), 50% (one creditor) and 75% (three creditors, 25% each) of its KV on peers, the
   remote micro-attention overlapping the local part or not (--no-overlap rows). Every
   configuration runs --rounds times, interleaved; medians. Target: <= 1.25x all-local at
   75% remote. --batch-invariant (the model's mode, ModelConfig.batch_invariant; auto, as
   served, by default): in the mode the parts run one after another in key order, each
   going on from the one before's state (attention/dist.py), never overlapping, so its rows
   are the no-overlap ones; both: the model loaded in each mode, every configuration of
   both in each round, each mode against its own all-local run.
3. With --ray: the same request over 2 Ray runners (actors in their own processes, behind
   the Scheduler, on a local Ray): all local (runners big enough) against about half of its
   KV on the other process, over each data plane (transport socket: scheduler/distkv/channel.py;
   ray: actor calls). Time per token from the stream's token arrival times after the first;
   --rounds rounds, interleaved, medians."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.args import add_model, add_rounds  # noqa: E402
from common.report import describe_machine, print_table, pyplot, save_plot, write_json  # noqa: E402

from punica_x.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig  # noqa: E402
from punica_x.core import SamplingParams  # noqa: E402
from punica_x.engine import Engine  # noqa: E402
from punica_x.models.loader import load_model  # noqa: E402
from punica_x.request import EngineRequest
from scheduler.distkv.network import KVNetwork, default_caps  # noqa: E402

BLOCK = 16


def engines(loaded, model: str, sizes: list[int], overlap: bool = True) -> list[Engine]:
    """One engine per size (blocks), all in one DistKV network: engine 0 is the debtor."""
    net = KVNetwork()
    out = []
    mode = "on" if loaded.invariance.on else "off"
    for i, n in enumerate(sizes):
        config = EngineConfig(
            model=ModelConfig(model=model, batch_invariant=mode),
            cache=CacheConfig(block_size=BLOCK, num_blocks=n),
            batch=BatchConfig(max_batched_tokens=512),
        )
        e = Engine(config, loaded)
        rid = f"runner-{i}"
        borrower = net.add_runner(rid)
        net.attach(rid, e.distkv.enable(rid, borrower, default_caps(n), overlap, net.pool))
        out.append(e)
    return out


def longest(loaded, model: str, blocks: int, n: int) -> dict:
    """Run the longest prompt n runners of `blocks` blocks admit; return what was served."""
    debtor = engines(loaded, model, [blocks] * n)[0]
    capacity = debtor.distkv.capacity_blocks() * BLOCK  # tokens one request can hold
    prompt = [(7 * i) % 20000 + 100 for i in range(capacity - 2)]
    debtor.check_prompt(prompt)
    t0 = time.perf_counter()
    debtor.add_request(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    final = None
    while debtor.has_unfinished():
        for out in debtor.step():
            final = out if out.finished else final
    ok = final is not None and final.error is None and len(final.token_ids) == 2
    return {
        "runners": n,
        "blocks_per_runner": blocks,
        "served_tokens": len(prompt) + len(final.token_ids) if ok else 0,
        "seconds": time.perf_counter() - t0,
        "completed": ok,
    }


def decode_time(
    loaded, model: str, context: int, remote: float, creditors: int, overlap: bool, decode: int
) -> float:
    """Seconds per decode token of one request with `context` tokens, `remote` of them on
    `creditors` peers (0: all local)."""
    need = -(-(context + decode + 1) // BLOCK)
    local = need + 2 if remote == 0 else round(need * (1 - remote))
    peer = -(-(need - local) // max(1, creditors))
    sizes = [local] + [-(-(peer + 2) * 10 // 9)] * creditors  # lend cap 90%
    debtor = engines(loaded, model, sizes, overlap)[0]
    prompt = [(13 * i) % 20000 + 100 for i in range(context)]
    req = debtor.add_request(
        prompt, SamplingParams(max_tokens=decode + 1, temperature=0, ignore_eos=True)
    )
    while not req.output_token_ids:  # prefill (an output's text may hold tokens back)
        debtor.step()
    t0 = time.perf_counter()
    steps = 0
    while debtor.has_unfinished():
        debtor.step()
        steps += 1
    return (time.perf_counter() - t0) / steps


def ray_decode(model: str, context: int, decode: int, transport: str | None) -> dict:
    """Seconds per decode token of one greedy request with `context` tokens on 2 Ray runners:
    transport None: each runner holds it all; else each holds ~55% and the debtor borrows
    the rest on the other over `transport`."""
    import asyncio

    from scheduler.cluster import Scheduler
    from scheduler.runners.ray_runner import RayRunner

    need = -(-(context + decode + 1) // BLOCK)
    size = need + 2 if transport is None else -(-(need // 2 + 2) * 10 // 9)
    config = EngineConfig(
        model=ModelConfig(model=model, max_model_len=context + decode + 64),
        cache=CacheConfig(block_size=BLOCK, num_blocks=size),
        batch=BatchConfig(max_batched_tokens=512),
    )
    runners = [RayRunner(config, f"runner-{i}") for i in range(2)]
    sched = Scheduler(runners, distkv_transport=transport or "socket")
    prompt = [(13 * i) % 20000 + 100 for i in range(context)]
    sp = SamplingParams(max_tokens=decode + 1, temperature=0, ignore_eos=True)

    async def go() -> list[float]:
        stamps: list[float] = []
        async for out in await sched.open(EngineRequest(prompt, sp, None, "ray-decode")):
            stamps += [time.perf_counter()] * len(out.new_token_ids)
        return stamps

    try:
        stamps = asyncio.run(go())
    finally:
        sched.shutdown()
    if len(stamps) != decode + 1:
        raise RuntimeError(f"{len(stamps)} tokens of {decode + 1}")
    return {
        "s_per_token": (stamps[-1] - stamps[0]) / decode,
        "remote_blocks": max(0, need - size),
        "need_blocks": need,
    }


RAY_CONFIGS = [("all local", None), ("~45% remote, socket", "socket"), ("~45% remote, ray", "ray")]


def ray_section(args, model: str) -> list[dict]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        runs: dict[str, list[dict]] = {label: [] for label, _ in RAY_CONFIGS}
        for r in range(args.rounds):
            for label, transport in RAY_CONFIGS:
                runs[label].append(ray_decode(model, args.context, args.decode, transport))
            print(
                f"  ray round {r + 1}: "
                + ", ".join(f"{k} {1e3 * v[-1]['s_per_token']:.1f} ms" for k, v in runs.items()),
                flush=True,
            )
    finally:
        ray.shutdown()
    base = statistics.median(x["s_per_token"] for x in runs["all local"])
    rows = []
    for label, _ in RAY_CONFIGS:
        med = statistics.median(x["s_per_token"] for x in runs[label])
        last = runs[label][-1]
        rows.append(
            {
                "config": label,
                "remote_fraction": last["remote_blocks"] / last["need_blocks"],
                "ms_per_token": 1e3 * med,
                "vs_all_local": med / base,
                "raw_ms": [1e3 * x["s_per_token"] for x in runs[label]],
            }
        )
    print_table(
        rows,
        ["config", "remote_fraction", "ms_per_token", "vs_all_local"],
        f"Ray runners (2 processes), decode, {args.context} tokens of context",
    )
    return rows


CONFIGS = [  # (label, remote fraction, creditors, overlap)
    ("all local", 0.0, 0, True),
    ("50% remote", 0.5, 1, True),
    ("50% remote, no overlap", 0.5, 1, False),
    ("75% remote", 0.75, 3, True),
    ("75% remote, no overlap", 0.75, 3, False),
]


def longest_section(args, loaded, model: str) -> list[dict]:
    """Section 1: the longest context 1, 2 and 4 runners of --blocks blocks serve."""
    lengths = [longest(loaded, model, args.blocks, n) for n in (1, 2, 4)]
    single = lengths[0]["served_tokens"]
    for row in lengths:
        row["vs_n_x_single"] = row["served_tokens"] / (row["runners"] * single)
    print_table(
        lengths,
        ["runners", "blocks_per_runner", "served_tokens", "vs_n_x_single", "completed", "seconds"],
        "longest context served",
    )
    return lengths


def mode_configs(loads: dict[str, object]) -> list[tuple[str, object, tuple]]:
    """(label, loaded model, CONFIGS entry) to time: every entry per mode, labelled with
    the mode where there are two; in the batch-invariant mode the parts never overlap, so
    only its no-overlap entries (and all local)."""
    out = []
    for mode, loaded in loads.items():
        for c in CONFIGS:
            if loaded.invariance.on and c[1] and c[3]:
                continue
            out.append((f"{mode}: {c[0]}" if len(loads) > 1 else c[0], loaded, c))
    return out


def decode_section(args, loads: dict, model: str) -> tuple[list[dict], dict[str, list[float]]]:
    """Section 2: decode time per token at each configuration of each mode (mode_configs),
    --rounds rounds interleaved; returns (rows of medians, every round's seconds each)."""
    configs = mode_configs(loads)
    times: dict[str, list[float]] = {label: [] for label, _, _ in configs}
    for loaded in loads.values():
        decode_time(loaded, model, 256, 0.5, 1, False, 4)  # warm-up
    for r in range(args.rounds):
        for label, loaded, (_, remote, creditors, overlap) in configs:
            times[label].append(
                decode_time(loaded, model, args.context, remote, creditors, overlap, args.decode)
            )
        print(
            f"  round {r + 1}: " + ", ".join(f"{k} {1e3 * v[-1]:.1f} ms" for k, v in times.items()),
            flush=True,
        )
    decode = []
    for label, loaded, _ in configs:
        base = next(lb for lb, ld, cc in configs if ld is loaded and not cc[1])  # all local
        decode.append(
            {
                "config": label,
                "batch_invariant": loaded.invariance.on,
                "ms_per_token": 1e3 * statistics.median(times[label]),
                "vs_all_local": statistics.median(times[label]) / statistics.median(times[base]),
            }
        )
    print_table(
        decode,
        ["config", "batch_invariant", "ms_per_token", "vs_all_local"],
        f"decode, {args.context} tokens of context",
    )
    return decode, times


def load_modes(mc: ModelConfig, mode: str) -> dict:
    """{mode label: the model loaded in it}: one load (its decision the label) or, for
    both, one per mode."""
    if mode != "both":
        loaded = load_model(replace(mc, batch_invariant=mode))
        return {"on" if loaded.invariance.on else "off": loaded}
    return {m: load_model(replace(mc, batch_invariant=m)) for m in ("off", "on")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=32, help="KV blocks per runner (longest)")
    ap.add_argument("--context", type=int, default=2048, help="tokens held (decode timing)")
    ap.add_argument("--decode", type=int, default=32)
    add_rounds(ap)
    add_model(ap)
    ap.add_argument("--ray", action="store_true", help="also time decode over 2 Ray runners")
    ap.add_argument("--ray-only", action="store_true", help="only the Ray runners' section")
    ap.add_argument(
        "--batch-invariant",
        choices=["auto", "on", "off", "both"],
        default="auto",
        help="the model's batch-invariant mode (decode section); both: on and off side by side",
    )
    args = ap.parse_args()
    machine = describe_machine()
    print(machine)
    mc = ModelConfig(
        model=args.model, max_model_len=max(args.context, 4 * args.blocks * BLOCK) + 64
    )
    if args.ray_only:
        ray_rows = ray_section(args, mc.model)
        write_json("bench_distkv_ray", {"machine": machine, "args": vars(args), "ray": ray_rows})
        plot_ray(ray_rows, args.context)
        return
    loads = load_modes(mc, args.batch_invariant)
    loaded = next(iter(loads.values()))
    for mode, each in loads.items():
        print(f"batch invariance ({mode}): {each.invariance.reason}")
    model = mc.model
    lengths = longest_section(args, loaded, model)
    decode, times = decode_section(args, loads, model)
    ray_rows = ray_section(args, model) if args.ray else None
    if ray_rows:
        plot_ray(ray_rows, args.context)
    write_json(
        "bench_distkv",
        {
            "machine": machine,
            "args": vars(args),
            "longest": lengths,
            "decode": decode,
            "raw_s": times,
            "ray": ray_rows,
        },
    )
    plot(lengths, decode, args.context)


def plot(lengths: list[dict], decode: list[dict], context: int) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    n = [r["runners"] for r in lengths]
    a.plot(n, [r["served_tokens"] for r in lengths], "-o", label="served")
    a.plot(n, [r * lengths[0]["served_tokens"] for r in n], "--", label="N x one runner")
    a.set_xlabel("runners")
    a.set_ylabel("longest context (tokens)")
    a.legend()
    a.grid(alpha=0.3)
    b.barh([d["config"] for d in decode], [d["ms_per_token"] for d in decode])
    b.set_xlabel(f"ms per decode token ({context} tokens of context)")
    fig.tight_layout()
    save_plot("bench_distkv", fig)


def plot_ray(rows: list[dict], context: int) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh([r["config"] for r in rows], [r["ms_per_token"] for r in rows])
    ax.set_xlabel(f"ms per decode token, 2 Ray runners ({context} tokens of context)")
    fig.suptitle(describe_machine(), fontsize=8)
    fig.tight_layout()
    save_plot("bench_distkv_ray", fig)


if __name__ == "__main__":
    main()
