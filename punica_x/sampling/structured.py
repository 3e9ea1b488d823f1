"""Structured output: decoding constrained to a JSON schema, through llguidance (a Rust grammar
engine: per-step token masks in microseconds, no torch or triton dependency; xgrammar, the
other candidate vLLM ships, pulls triton). A schema is compiled once (cached by its text);
each constrained request holds its own matcher, and only its rows of a batch are masked.

JSON is generated compact (no optional whitespace), so a bounded schema always ends: a model
can never spin in whitespace until max_tokens."""

from __future__ import annotations

import functools
import json

COMPILE_OPTIONS = {"whitespace_flexible": False}
JSON_OBJECT = json.dumps({"type": "object"})  # response_format {"type": "json_object"}


def canonical_schema(schema: dict) -> str:
    """The cache key and the form SamplingParams.json_schema holds."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


@functools.lru_cache(maxsize=256)
def compile_json_schema(schema_json: str) -> str:
    """llguidance grammar of a JSON schema (text); ValueError naming what is wrong."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema_json, defaults=COMPILE_OPTIONS
        )
    except ValueError as exc:
        raise ValueError(f"invalid JSON schema: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"unsupported JSON schema: {error}")
    return grammar


class Grammars:
    """Per engine: the tokenizer as llguidance sees it, and a matcher per request."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids) -> None:
        import llguidance.hf

        eos = list(eos_token_ids) or None
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size

    def matcher(self, schema_json: str):
        """A fresh llguidance.LLMatcher for one request; ValueError if the schema is bad."""
        import llguidance

        grammar = compile_json_schema(schema_json)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"unsupported JSON schema: {error}")
        return llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)


def mask_constrained(logits, requests) -> None:
    """logits: [B, V], in place: each row whose request has a matcher keeps only the tokens
    its grammar allows next."""
    rows = [i for i, r in enumerate(requests) if r.matcher is not None]
    if not rows:
        return
    import llguidance.torch as lt

    bitmask = lt.allocate_token_bitmask(len(rows), logits.shape[-1])
    for j, i in enumerate(rows):
        lt.fill_next_token_bitmask(requests[i].matcher, bitmask, j)
    if logits.device.type != "cpu":  # the grammars fill it on the host; apply it where they are
        bitmask = bitmask.to(logits.device, non_blocking=True)
    sub = logits[rows]
    lt.apply_token_bitmask_inplace(sub, bitmask)
    logits[rows] = sub
