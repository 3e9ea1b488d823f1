"""LoraLinear: the dense GEMM prefetches the adapter weights of the SGMV launch after it."""

import os

import pytest
import torch

from punica_x.layers.linear import LoraLinear
from punica_x.ops.dense import PackedCpuDense, TorchDense
from punica_x.ops.sgmv import get_backend
from punica_x.ops.sgmv_weights import PREFETCH_MAX_ROWS, SgmvWeights
from punica_x.runtime import LoraBatchMeta

LAYERS, H_IN, SLICES, RANK = 3, 64, (48, 32), 8


def _weights(g, adapters: list[int | None], dtype) -> SgmvWeights:
    """One one-row segment per entry: adapter index or None; adapters have 3 layers."""
    n = max((a for a in adapters if a is not None), default=-1) + 1
    a = [torch.randn(LAYERS, 2 * RANK, H_IN, generator=g).to(dtype) for _ in range(n)]
    b = [torch.randn(LAYERS, RANK * sum(SLICES), generator=g).to(dtype) for _ in range(n)]
    return SgmvWeights.build(
        list(range(len(adapters) + 1)),
        [None if i is None else a[i] for i in adapters],
        [None if i is None else b[i] for i in adapters],
        [[RANK, RANK]] * len(adapters),
        SLICES,
        "cpu",
    )


def test_prefetch_spans_are_each_adapters_layer():
    """Each few-row segment's A and B at each layer; a segment of many rows reuses its
    weights from the caches anyway and is left out."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    w = _weights(g, [0, None, 1, 0], torch.bfloat16)
    spans = w.prefetch_spans
    assert spans.shape == (LAYERS, 6, 2) and spans.dtype == torch.int64
    for layer in range(LAYERS):
        want = []
        for a, b in zip(w.a, w.b):
            if a is not None:
                want += [
                    [a[layer].data_ptr(), a[layer].nbytes],
                    [b[layer].data_ptr(), b[layer].nbytes],
                ]
        assert spans[layer].tolist() == want
        assert torch.equal(w.prefetch_layers[layer], spans[layer])
    assert isinstance(w.prefetch_layers, tuple) and len(w.prefetch_layers) == LAYERS
    assert _weights(g, [None, None], torch.bfloat16).prefetch_spans is None
    assert _weights(g, [None, None], torch.bfloat16).prefetch_layers is None
    a, b = w.a[0], w.b[0]
    rows = PREFETCH_MAX_ROWS + 1
    many = SgmvWeights.build([0, rows, rows + 1], [a, a], [b, b], [[RANK, RANK]] * 2, SLICES, "cpu")
    assert many.prefetch_spans[1].tolist() == [
        [a[1].data_ptr(), a[1].nbytes],
        [b[1].data_ptr(), b[1].nbytes],
    ]


class Recording:
    """A dense backend that records the prefetch hint it is given."""

    def __init__(self, inner, takes: bool) -> None:
        self.inner, self.name, self.takes_prefetch = inner, inner.name, takes
        self.seen: list[torch.Tensor | None] = []

    def prepare(self, weight):
        return self.inner.prepare(weight)

    def forward(self, x, prepared, n, bias, prefetch=None):
        self.seen.append(prefetch)
        return self.inner.forward(x, prepared, n, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_linear_hands_the_next_launch_to_the_gemm(dtype, cpu_isa):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    w = _weights(g, [1, 0, None, 1], dtype)
    lora = LoraBatchMeta(groups={"qkv": w}, workspace=torch.zeros(4, 2 * RANK))
    x = torch.randn(4, H_IN, generator=g).to(dtype)
    weight = torch.randn(sum(SLICES), H_IN, generator=g).to(dtype)
    outs = {}
    for takes in (True, False):
        layer = LoraLinear(H_IN, SLICES, "qkv", False, dtype, torch.device("cpu"))
        layer.weight.data.copy_(weight)
        backend = Recording(PackedCpuDense(cpu_isa), takes)
        layer.prepare(backend)
        outs[takes] = layer(x, lora, 2, get_backend("cpu", "cpu", dtype))
        want = [w.prefetch_spans[2]] if takes else [None]
        assert len(backend.seen) == 1 and (
            backend.seen[0] is None if not takes else torch.equal(backend.seen[0], want[0])
        )
        layer(x, None, 2, None)  # no LoRA this step: nothing to prefetch
        assert backend.seen[-1] is None
    assert torch.equal(outs[True], outs[False])


def test_a_launch_with_nothing_to_prefetch_hands_no_hint(cpu_isa):
    """One segment of many rows (no few-row segment) at a layer past the first."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    one = _weights(g, [0], torch.float32)
    rows = PREFETCH_MAX_ROWS + 3
    w = SgmvWeights.build([0, rows], one.a, one.b, [[RANK, RANK]], SLICES, "cpu")
    lora = LoraBatchMeta(groups={"qkv": w}, workspace=torch.zeros(rows, 2 * RANK))
    layer = LoraLinear(H_IN, SLICES, "qkv", False, torch.float32, torch.device("cpu"))
    backend = Recording(PackedCpuDense(cpu_isa), True)
    layer.prepare(backend)
    x = torch.randn(rows, H_IN, generator=g)
    y = layer(x, lora, LAYERS - 1, get_backend("cpu", "cpu", torch.float32))
    assert backend.seen == [None] and y.shape == (rows, sum(SLICES))


def test_torch_dense_is_never_handed_a_hint():
    layer = LoraLinear(H_IN, SLICES, "qkv", False, torch.float32, torch.device("cpu"))
    layer.prepare(TorchDense())
    assert layer.prefetches is False
