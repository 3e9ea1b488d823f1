"""Which grammar engine for JSON-schema decoding: llguidance (what punica-x uses) or xgrammar?

On SmolLM2's tokenizer (49152 tokens), for a few schemas: the time to compile a schema, and
the time per generated token to compute the next-token mask and advance the matcher, walking
the tokens of a valid JSON document. xgrammar is optional here: its wheel depends on triton,
so install it without dependencies to compare (`pip install --no-deps xgrammar
apache-tvm-ffi`); without it only llguidance is measured.

    python benchmarks/bench_grammar.py
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from common.args import parser
from common.report import describe_machine, print_table, write_json

from punica_x import LLM

CASES = {
    "flat object": (
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "population": {"type": "integer"},
                "capital": {"type": "boolean"},
            },
            "required": ["city", "population", "capital"],
            "additionalProperties": False,
        },
        {"city": "Lyon", "population": 522250, "capital": False},
    ),
    "nested + arrays": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "scores": {"type": "array", "items": {"type": "number"}},
                "owner": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "email": {"type": "string"}},
                    "required": ["id", "email"],
                },
            },
            "required": ["name", "tags", "scores", "owner"],
        },
        {
            "name": "support-bot",
            "tags": ["lora", "tenant", "cpu"],
            "scores": [0.91, 0.87, 0.5],
            "owner": {"id": 42, "email": "ops@example.com"},
        },
    ),
    "enum list": (
        {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1},
        ["red", "blue", "blue", "green", "red"],
    ),
}


def bench_llguidance(tok, vocab, schema, ids):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_flexible": False}
    )
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    mask = lt.allocate_token_bitmask(1, vocab)
    per = []
    for t in ids:
        t0 = time.perf_counter()
        lt.fill_next_token_bitmask(matcher, mask, 0)
        ok = matcher.consume_token(t)
        per.append(time.perf_counter() - t0)
        assert ok, matcher.get_error()
    return setup, compile_s, per


def bench_xgrammar(tok, vocab, schema, ids):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(",", ":")
    )
    matcher = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, vocab)
    per = []
    for t in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        ok = matcher.accept_token(t)
        per.append(time.perf_counter() - t0)
        assert ok, t
    return setup, compile_s, per


def main() -> None:
    parser(__doc__).parse_args()  # no options; --help prints the docstring
    torch.set_num_threads(2)
    print(describe_machine(), flush=True)
    llm = LLM()
    tok, vocab = llm.tokenizer, llm.engine.model.dims.vocab_size
    engines = {"llguidance": bench_llguidance}
    try:
        import xgrammar  # noqa: F401

        engines["xgrammar"] = bench_xgrammar
    except ImportError:
        print("xgrammar not installed: measuring llguidance only")
    rows = []
    for case, (schema, doc) in CASES.items():
        ids = tok(json.dumps(doc, separators=(",", ":")), add_special_tokens=False).input_ids
        for name, fn in engines.items():
            fn(tok, vocab, schema, ids)  # warm: caches, lazy imports
            setup, compile_s, per = fn(tok, vocab, schema, ids)
            rows.append(
                {
                    "schema": case,
                    "engine": name,
                    "tokens": len(ids),
                    "tokenizer_setup_ms": setup * 1e3,
                    "compile_ms": compile_s * 1e3,
                    "mask_us_median": statistics.median(per) * 1e6,
                    "mask_us_max": max(per) * 1e6,
                }
            )
    print_table(rows, list(rows[0]), "JSON-schema grammar engines on SmolLM2's tokenizer")
    path = write_json("bench_grammar", {"rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
