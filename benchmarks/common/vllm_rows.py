"""bench_generate's vLLM CPU columns: the same prompts, adapters and workloads served by
vLLM's CPU build (common/peers.py runs it in its own virtual environment), per thread
binding."""

from __future__ import annotations

from pathlib import Path

from common.peers import run as run_peer
from common.workload import make_prompts, weights_dir
from punica_x import LLM


def add_vllm(rows, args, llm: LLM, prompts, paths, names, tmp: Path) -> dict:
    """vLLM CPU's tok/s per thread binding, into the rows (vllm[_bind]_tok_s, x_vllm[_bind]);
    returns {bind: {workload or "backbone": tok/s}}."""
    peer: dict[str, dict[str, float]] = {}
    for bind in args.peer_bind.split(","):
        peer[bind] = run_vllm(args, llm, prompts, paths, names, tmp, bind)
        suffix = "" if bind == "all" else f"_{bind}"
        for row in rows:
            row[f"vllm{suffix}_tok_s"] = peer[bind][row["workload"]]
            row[f"x_vllm{suffix}"] = row["ours_tok_s"] / row[f"vllm{suffix}_tok_s"]
    return peer


def run_vllm(args, llm: LLM, prompts, paths, names, tmp: Path, bind: str) -> dict[str, float]:
    """tok/s of vLLM CPU on the same prompts and adapters: one engine with LoRA for the
    workloads, one without for the backbone (each in its own process)."""
    job = dict(
        out_dir=str(tmp),
        model=str(weights_dir(llm, getattr(args, "model", None))),  # a GGUF's float copy
        prompts=prompts,
        warm_prompts=make_prompts(llm.tokenizer, len(prompts), warm_up=True),
        max_tokens=args.max_tokens,
        dtype=args.peer_dtype,
        rank=args.rank,
        adapters={f"a{i}": str(p) for i, p in enumerate(paths)},
    )
    print("running vLLM CPU (LoRA workloads, then the backbone) ...", flush=True)
    out = run_peer({**job, "name": "lora", "lora": True, "workloads": names}, args.threads)
    backbone = {"backbone": [None] * len(prompts)}
    out |= run_peer({**job, "name": "base", "lora": False, "workloads": backbone}, args.threads)
    return out
