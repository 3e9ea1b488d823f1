"""Is one checkout's engine as fast as another's? (a restructuring's before and after)

Run once per checkout, alternating (the machine's speed drifts by tens of percent over
minutes, so pairs of neighbouring runs are what compare): SmolLM2-135M-Instruct at the
serving dtype, 32 requests, rank-16 adapters on all 7 projections; tokens/s of a whole
generation (32 tokens each) and the median decode step (common/engine_timing) for the
backbone, Distinct and Identical. The checkout's own punica_x and benchmarks/common are
imported (its path first on sys.path); one JSON line on stdout, prefixed "AB ".

    git worktree add /tmp/before <commit>
    for i in 1 2; do for t in . /tmp/before; do python benchmarks/bench_trees.py $t; done; done
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":
    ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def main() -> None:
    import torch
    from common.engine_timing import decode_step_time, run_ours, warm_up
    from common.workload import load_adapters, make_adapters, make_prompts, workload_names

    import punica_x
    from punica_x import LLM, SamplingParams

    torch.set_num_threads(2)
    n = 32
    llm = LLM()
    prompts = make_prompts(llm.tokenizer, n)
    paths = make_adapters(llm.engine.loaded.model_dir, n, 16, Path(tempfile.mkdtemp()))
    load_adapters(llm, paths)
    names = {"backbone": [None] * n, **workload_names(n)}
    sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    warm_up(llm, prompts)
    out = {"tree": str(ROOT), "package": punica_x.__file__, "dtype": str(llm.engine.dtype)}
    for w in ("backbone", "distinct", "identical"):
        out[f"{w}_tok_s"] = run_ours(llm, prompts, names[w], sp)
        steps = [decode_step_time(llm, prompts, names[w], sp, 16) for _ in range(3)]
        out[f"{w}_step_ms"] = 1e3 * statistics.median(steps)
    print("AB " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
