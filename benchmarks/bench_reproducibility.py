"""How often does the same greedy request give another answer, with the batch-invariant mode
off and on, on this CPU's kernels (ModelConfig.batch_invariant: ops/invariance.py)?

Issue 50's "what a new user sees", counted: each check runs a request two ways that should
not matter and compares the two completions, token ids and logprobs (the chosen token's and
the top-2 alternatives', bit for bit). Per mode (on, off), same model, dtype and adapters:

- prefix_hit: a ~1,000-token system prompt (--system-repeats 95) and a question, on the base
  and two adapters (3 questions x 3 models): the first run computes the prompt whole (a miss,
  as a server with --no-prefix-caching would), the second reuses its cached KV (a hit).
- batch_32: 6 questions x 3 models alone, then at every position of a batch of 32 of them.
- chunked: the prefix_hit prompts prefilled in chunks of 64 tokens (max_batched_tokens=64,
  prefix caching off) against the whole prompt.

Greedy, --max-tokens tokens each, ignore_eos. Adapters: bench_generate's (rank 16 on all 7
projections, random). Default: the default server's model and weights in bfloat16, where the
mode matters (float32 rarely flips a token: --dtype float32 shows it).

    python benchmarks/bench_reproducibility.py [--dtype bfloat16] [--max-tokens 32]
"""

from __future__ import annotations

import torch
from common.args import add_dtype, add_max_tokens, add_rank, add_threads, parser
from common.invariance_pairs import MODES
from common.report import describe_machine, print_table, pyplot, save_plot, write_json
from common.scratch import scratch_dir
from common.workload import TOPICS, load_adapters, make_adapters

from punica_x import LLM, SamplingParams

QUESTIONS = [f"Tell me {what} about {t}." for what in ("one fact", "a story") for t in TOPICS[:3]]
SYSTEM = "You are a careful assistant who answers briefly and precisely."
MODELS = [None, "a0", "a1"]
CHECKS = ("prefix_hit", "batch_32", "chunked")


def parse_args():
    ap = parser(__doc__)
    add_dtype(ap, help="the serving dtype")
    ap.add_argument("--quantization", default="auto", choices=["auto", "none"])
    add_max_tokens(ap, default=32)
    add_rank(ap)
    add_threads(ap)
    ap.add_argument(
        "--system-repeats", type=int, default=95, help="the system prompt's sentence, times"
    )
    ap.set_defaults(dtype="bfloat16")
    return ap.parse_args()


def serve(args, mode: str, paths, **kwargs) -> LLM:
    llm = LLM(dtype=args.dtype, quantization=args.quantization, batch_invariant=mode, **kwargs)
    load_adapters(llm, paths)
    return llm


def chat(llm: LLM, question: str, system: int = 0) -> str:
    """The chat prompt of `question`, after a system prompt of SYSTEM `system` times if any."""
    turns = [{"role": "system", "content": " ".join([SYSTEM] * system)}] if system else []
    turns.append({"role": "user", "content": question})
    return llm.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)


def result(out) -> tuple:
    """(token ids, per token (logprob, top alternatives)): compared bit for bit."""
    return tuple(out.token_ids), tuple((lp.logprob, lp.top) for lp in out.logprobs)


def generate(llm: LLM, prompts: list[str], models: list, sp) -> list[tuple]:
    return [result(o) for o in llm.generate(prompts, models, sp)]


def compare(pairs: list[tuple[tuple, tuple]]) -> dict:
    """How many of the (a, b) completion pairs differ in their tokens, and in their logprobs."""
    tokens = sum(a[0] != b[0] for a, b in pairs)
    logprobs = sum(a != b for a, b in pairs)
    return {"compared": len(pairs), "tokens_differ": tokens, "logprobs_differ": logprobs}


def run_mode(args, mode: str, paths, sp) -> dict[str, dict]:
    """{check: compare(...)} for one mode."""
    llm = serve(args, mode, paths)
    combos = [(q, m) for q in range(len(QUESTIONS)) for m in MODELS]
    short = {q: chat(llm, text) for q, text in enumerate(QUESTIONS)}
    alone = {c: generate(llm, [short[c[0]]], [c[1]], sp)[0] for c in combos}
    slots = [combos[i % len(combos)] for i in range(32)]
    batch = generate(llm, [short[q] for q, _ in slots], [m for _, m in slots], sp)
    long_pairs = [(q, m) for q in range(3) for m in MODELS]
    long = {q: chat(llm, QUESTIONS[q], args.system_repeats) for q in range(3)}
    miss = {p: generate(llm, [long[p[0]]], [p[1]], sp)[0] for p in long_pairs}
    hit = {p: generate(llm, [long[p[0]]], [p[1]], sp)[0] for p in long_pairs}
    del llm
    chunks = serve(args, mode, paths, max_batched_tokens=64, prefix_caching=False)
    chunked = {p: generate(chunks, [long[p[0]]], [p[1]], sp)[0] for p in long_pairs}
    return {
        "prefix_hit": compare([(miss[p], hit[p]) for p in long_pairs]),
        "batch_32": compare([(alone[c], out) for c, out in zip(slots, batch)]),
        "chunked": compare([(miss[p], chunked[p]) for p in long_pairs]),
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    print(describe_machine(), flush=True)
    probe = LLM(dtype=args.dtype, quantization=args.quantization, batch_invariant="auto")
    info = probe.engine.describe()
    paths = make_adapters(probe.engine.loaded.model_dir, 2, args.rank, scratch_dir("bench-repro-"))
    del probe
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=2)
    found = {mode: run_mode(args, mode, paths, sp) for mode in MODES}
    rows = [{"check": c, "mode": m, **found[m][c]} for c in CHECKS for m in MODES]
    summary = {
        "dtype": info.model.dtype,
        "weights": info.model.weight_format,
        "auto": info.batch_invariant,
        "auto_reason": info.batch_invariant_reason,
        "max_tokens": args.max_tokens,
    }
    report(args, rows, summary)


def report(args, rows, summary) -> None:
    title = (
        f"the same greedy request run two ways, batch_invariant on and off, {summary['dtype']} "
        f"({summary['weights']} weights), {summary['max_tokens']} tokens; auto here: "
        f"{summary['auto_reason']}"
    )
    cols = ["check", "mode", "compared", "tokens_differ", "logprobs_differ"]
    print_table(rows, cols, title)
    name = f"bench_reproducibility_{summary['dtype']}_q{args.quantization}"
    path = write_json(name, {"args": vars(args), "summary": summary, "rows": rows})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for k, mode in enumerate(MODES):
        mine = [r for r in rows if r["mode"] == mode]
        xs = [i + 0.4 * k for i in range(len(mine))]
        ax.bar(xs, [r["tokens_differ"] / r["compared"] for r in mine], width=0.4, label=mode)
    ax.set_xticks([i + 0.2 for i in range(len(CHECKS))], CHECKS)
    ax.set_ylabel("share of completions whose tokens differ")
    ax.legend(title="batch_invariant")
    fig.suptitle(title[:150], fontsize=7)
    save_plot(name, fig)
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
