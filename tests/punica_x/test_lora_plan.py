"""The step's LoRA metadata is reused while its segments and adapter weights are unchanged,
and built anew (never stale) when either changes."""

from __future__ import annotations

import torch

from punica_x.batching.lora_plan import LoraPlanner
from punica_x.lora.adapter import LoraAdapter

H_OUT = {"qkv": (8, 4, 4), "o": (8,)}
RANK = 2


def adapter(seed: int, groups=("qkv", "o")) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    tensors, ranks = {}, {}
    for name in groups:
        h_out = H_OUT[name]
        a = torch.randn(3, RANK * len(h_out), 8, generator=g)
        b = torch.randn(3, RANK * sum(h_out), generator=g)
        tensors[name], ranks[name] = (a, b), (RANK,) * len(h_out)
    return LoraAdapter(RANK, 4.0, 2.0, ("q_proj",), ranks, tensors, f"{seed:064x}", "float32")


def planner() -> LoraPlanner:
    return LoraPlanner(H_OUT, torch.device("cpu"))


def test_same_segments_and_weights_reuse_the_plan():
    p, a, b = planner(), adapter(1), adapter(2)
    first = p.plan([0, 1, 3], [a, b])
    assert p.plan([0, 1, 3], [a, b]) is first
    assert p.plan((0, 1, 3), (a, b)) is first
    assert p.builds == 1
    assert first.groups["qkv"].seg_host == (0, 1, 3)
    assert first.workspace.shape == (3, RANK * 3)


def test_any_change_builds_a_new_plan():
    p, a, b = planner(), adapter(1), adapter(2)
    base = p.plan([0, 1, 3], [a, b])
    moved = p.plan([0, 2, 3], [a, b])  # other rows per segment
    assert moved is not base and moved.groups["o"].seg_host == (0, 2, 3)
    swapped = p.plan([0, 2, 3], [b, a])  # other adapters per segment
    assert swapped is not moved
    assert swapped.groups["o"].a[0] is b.groups["o"][0]
    reloaded = adapter(2)  # equal values, another object (a reload or a new version)
    again = p.plan([0, 2, 3], [reloaded, a])
    assert again is not swapped and again.groups["o"].a[0] is reloaded.groups["o"][0]
    grown = p.plan([0, 2, 3, 4], [reloaded, a, None])  # a row without an adapter joined
    assert grown.workspace.shape[0] == 4 and grown.groups["o"].a[2] is None
    assert p.builds == 5


def test_no_adapter_in_the_batch_plans_nothing():
    p = planner()
    assert p.plan([0, 4], [None]) is None
    assert p.plan([0, 1, 4], [None, None]) is None
    assert p.builds == 0


def test_groups_an_adapter_lacks_are_left_out():
    p = planner()
    meta = p.plan([0, 2], [adapter(3, groups=("o",))])
    assert set(meta.groups) == {"o"}


def test_forget_drops_the_kept_plan_and_its_tensors():
    p, a = planner(), adapter(1)
    first = p.plan([0, 2], [a])
    p.forget()
    assert p._meta is None and p._key is None
    assert p.plan([0, 2], [a]) is not first
    assert p.builds == 2
