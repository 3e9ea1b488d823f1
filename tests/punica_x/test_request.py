"""EngineRequest: the one type a request travels in from its caller to the engine; its
fields' types are checked at construction, so a hostile value is refused before any runner
sees it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from punica_x import SamplingParams
from punica_x.core import Resume
from punica_x.errors import InvalidRequest
from punica_x.request import EngineRequest

SP = SamplingParams(max_tokens=4)


def test_fields_are_kept_and_token_ids_become_a_tuple_of_ints():
    req = EngineRequest([1, np.int64(2), torch.tensor(3)], SP, "a", "r1", "salt")
    assert req.prompt == (1, 2, 3) and all(type(t) is int for t in req.prompt)
    assert (req.sampling, req.adapter, req.request_id, req.cache_salt) == (SP, "a", "r1", "salt")
    assert req.resume is None
    assert EngineRequest(range(3), SP, None, "r").prompt == (0, 1, 2)
    assert EngineRequest((), SP, None, "r").prompt == ()  # empty: the runner refuses it


def test_resumed_keeps_every_other_field():
    req = EngineRequest([1, 2], SP, "a", "r1", "salt")
    assert req.resumed(None) is req
    moved = req.resumed(Resume(output_token_ids=(7, 8)))
    assert moved.resume.output_token_ids == (7, 8) and moved.resumed(moved.resume) is moved
    assert (moved.prompt, moved.sampling, moved.adapter, moved.request_id, moved.cache_salt) == (
        req.prompt,
        SP,
        "a",
        "r1",
        "salt",
    )
    with pytest.raises(AttributeError):  # frozen: what a runner got cannot change under it
        req.adapter = "b"


@pytest.mark.parametrize(
    "prompt",
    ["hello", b"\x01\x02", {"a": 1}, None, 5, 1.5, [1, 2.0], [1, True], [1, "2"], [[1]], [None]],
)
def test_prompts_that_are_not_token_ids_are_refused(prompt):
    with pytest.raises(InvalidRequest, match="prompt") as info:
        EngineRequest(prompt, SP, None, "r")
    assert info.value.param == "prompt"


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("sampling", None, "sampling must be SamplingParams"),
        ("sampling", {"max_tokens": 4}, "sampling must be SamplingParams"),
        ("adapter", 7, "adapter must be a name"),
        ("adapter", ["a"], "adapter must be a name"),
        ("request_id", "", "request_id must be a non-empty string"),
        ("request_id", None, "request_id must be a non-empty string"),
        ("request_id", 12, "request_id must be a non-empty string"),
        ("cache_salt", 5, "cache_salt must be a string"),
        ("cache_salt", b"salt", "cache_salt must be a string"),
        ("resume", (1, 2), "resume must be a Resume"),
    ],
)
def test_fields_of_the_wrong_type_are_refused(field, value, match):
    args = {"prompt": [1, 2], "sampling": SP, "adapter": None, "request_id": "r"}
    args[field] = value
    with pytest.raises(InvalidRequest, match=match):
        EngineRequest(**args)
