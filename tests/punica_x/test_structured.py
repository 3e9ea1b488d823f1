"""JSON-schema-constrained decoding: every constrained completion parses and validates, mixed
in one batch with unconstrained requests on other adapters, which stay exactly as they are."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers import tiny_llm

from punica_x import SamplingParams
from punica_x.core import FinishReason
from punica_x.sampling.structured import canonical_schema

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
            "color": {"enum": ["red", "green", "blue"]},
            "ok": {"type": "boolean"},
        },
        "required": ["count", "color", "ok"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
            "digits": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "maxItems": 2,
            },
        },
        "required": ["name", "digits"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def llm(tiny_model_dir, tiny_adapters):
    llm = tiny_llm(tiny_model_dir)
    for name in ("r4", "r8", "r16"):
        llm.load_adapter(name, str(tiny_adapters[name]))
    return llm


def test_constrained_outputs_validate_in_a_mixed_batch(llm):
    prompts, adapters, params, schemas = [], [], [], []
    for seed in range(8):
        for k, schema in enumerate(SCHEMAS):
            prompts.append(f"json please {seed} {k}")
            adapters.append(["r4", "r8", None][(seed + k) % 3])
            params.append(
                SamplingParams(
                    max_tokens=64, temperature=1.0, seed=seed, json_schema=canonical_schema(schema)
                )
            )
            schemas.append(schema)
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    free_prompts = ["the quick brown fox", "hello world"]
    alone = llm.generate(free_prompts, ["r16", None], free)
    outs = llm.generate(prompts + free_prompts, adapters + ["r16", None], params + [free, free])
    for out, schema in zip(outs, schemas):
        assert out.finish_reason is FinishReason.STOP, out.text
        jsonschema.validate(json.loads(out.text), schema)
    assert [o.token_ids for o in outs[len(prompts) :]] == [o.token_ids for o in alone]


def test_greedy_constrained_decoding_is_stable(llm):
    sp = SamplingParams(max_tokens=64, temperature=0, json_schema=canonical_schema(SCHEMAS[0]))
    a = llm.generate(["x"], ["r8"], sp)[0]
    b = llm.generate(["x", "y", "z"], ["r8", "r4", None], sp)[0]
    assert a.text == b.text
    jsonschema.validate(json.loads(a.text), SCHEMAS[0])


def test_invalid_schema_is_refused_at_submission(llm):
    with pytest.raises(ValueError, match="schema"):
        llm.generate(["x"], None, SamplingParams(json_schema='{"type": "nonsense"}'))
    assert not llm.engine.has_unfinished()
