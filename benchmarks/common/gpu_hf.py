"""bench_generate --device cuda's HF columns: HF transformers (bfloat16 on the same GPU, sdpa
attention) generating the same prompts as punica-x without adapters at every request count,
then HF + PEFT wrapped around that same model with a mixed-adapter batch (adapter_names=) on
--hf-workloads at the smallest count."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from common.report import log
from common.workload import workload_names


def hf_columns(rows, model_dir: Path, paths, prompts, counts, args) -> dict:
    """HF's tok/s beside ours in the rows: the backbone at every count, then PEFT wrapped
    around that same model (one copy in GPU memory) with a mixed batch on --hf-workloads at
    the smallest count; returns what goes in the summary."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:  # Llama 3's tokenizer has none: pad with EOS (masked anyway)
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = model.to(args.device).eval()
    by = {(r["requests"], r["workload"]): r for r in rows}
    _hf_tok_s(model, tok, prompts[:4], 4)  # warm-up
    for n in counts:
        by[n, "backbone"]["hf_tok_s"] = _hf_tok_s(model, tok, prompts[:n], args.max_tokens)
        log(f"HF backbone, {n} requests: {by[n, 'backbone']['hf_tok_s']:.1f} tok/s")
    small = min(counts)
    hf_workloads = [w for w in args.hf_workloads.split(",") if w]
    needed = sorted({a for w in hf_workloads for a in workload_names(small)[w]})
    if needed:
        model = PeftModel.from_pretrained(model, paths[int(needed[0][1:])], adapter_name=needed[0])
        for name in needed[1:]:
            model.load_adapter(paths[int(name[1:])], adapter_name=name)
        model.eval()
    for w in hf_workloads:
        names = workload_names(small)[w]
        row = by[small, w]
        row["hf_tok_s"] = _hf_tok_s(model, tok, prompts[:small], args.max_tokens, names)
        log(f"HF + PEFT mixed batch, {w}, {small} requests: {row['hf_tok_s']:.1f} tok/s")
    for row in rows:
        if "hf_tok_s" in row:
            row["x_hf"] = row["tok_s"] / row["hf_tok_s"]
    return {"hf": "transformers bfloat16 (+ PEFT adapter_names=), sdpa", "hf_adapters": needed}


def _hf_tok_s(model, tok, prompts, n: int, adapter_names=None) -> float:
    """Generated tokens/s of HF's greedy generate, n new tokens for every prompt."""
    extra = {"adapter_names": adapter_names} if adapter_names else {}
    t0 = time.perf_counter()
    enc = tok(prompts, return_tensors="pt", padding=True).to(model.device)
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=tok.pad_token_id or tok.eos_token_id,
            **extra,
        )
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (out.shape[1] - enc.input_ids.shape[1]) * len(prompts) / (time.perf_counter() - t0)
