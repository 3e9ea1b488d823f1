"""The packed CPU GEMM against torch on fresh random inputs, and backend selection."""

import os

import pytest
import torch

from punica_x.attention import get_attention_backend
from punica_x.attention.cpu import CpuAttention
from punica_x.ops.dense import PackedCpuDense, TorchDense, get_dense_backend


@pytest.mark.parametrize("m", [1, 3, 8, 17, 32, 64, 130])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (64, 48), (100, 50), (1536, 576), (7, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_gemm_matches_torch(m, k, n, bias, cpu_isa):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    w = torch.randn(n, k, generator=gen) * k**-0.5  # outputs O(1) whatever K
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    cpu = PackedCpuDense(cpu_isa)
    y = cpu.forward(x, cpu.prepare(w), n, b)
    ref = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


def test_packed_gemm_checks_inputs(cpu_isa):
    ext = PackedCpuDense(cpu_isa).ext
    assert ext.isa() == cpu_isa
    panel = ext.panel()  # 48 columns on AVX-512, 24 on AVX2
    packed = ext.pack(torch.randn(2 * panel, 32))
    with pytest.raises(RuntimeError, match=r"contiguous \[panels, 16, \d+\] for x with K=16"):
        ext.gemm(torch.empty(4, 2 * panel), torch.randn(4, 16), packed, 2 * panel, None)
    need = -(-200 // panel)
    with pytest.raises(RuntimeError, match=f"packed has 2 panels, N=200 needs {need}"):
        ext.gemm(torch.empty(4, 200), torch.randn(4, 32), packed, 200, None)
    packed = ext.pack(torch.randn(96, 32))
    with pytest.raises(RuntimeError, match="y must be"):
        ext.gemm(torch.empty(3, 96), torch.randn(4, 32), packed, 96, None)
    with pytest.raises(RuntimeError, match="x must be a float32 or bfloat16 CPU tensor"):
        ext.gemm(torch.empty(4, 96), torch.randn(4, 32).double(), packed, 96, None)


def test_compiled_backends_are_the_defaults_on_cpu():
    """No silent fallback: float32 on CPU runs the compiled dense and attention kernels."""
    assert os.environ.get("PUNICA_X_DENSE_BACKEND", "") in ("", "cpu")
    assert os.environ.get("PUNICA_X_ATTENTION_BACKEND", "") in ("", "cpu")
    dense = get_dense_backend("cpu", torch.float32)
    assert isinstance(dense, PackedCpuDense) and dense.ext.__file__.endswith(".so")
    assert isinstance(get_dense_backend("cpu", torch.bfloat16), PackedCpuDense)
    # float16: no compiled CPU kernel takes it, the default is torch; naming one is refused
    assert isinstance(get_dense_backend("cpu", torch.float16), TorchDense)
    attention = get_attention_backend("cpu")
    assert isinstance(attention, CpuAttention) and attention.ext.__file__.endswith(".so")
    with pytest.raises(
        ValueError, match="the cpu dense backend runs float32 or bfloat16 on cpu, not float16"
    ):
        get_dense_backend("cpu", torch.float16, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (7, 50), (101, 1)])  # odd K, N past a panel
def test_rows_read_back_from_the_layout_exactly(dtype, k, n, cpu_isa):
    """A tied LM head serves as the embedding: rows of W come back bit for bit from the
    packed panels (every ISA's layout) and from torch's transposed copy."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    w = torch.randn(n, k, generator=g).to(dtype)
    ids = torch.randint(0, n, (37,), generator=g)
    ids[0], ids[-1] = 0, n - 1
    for backend in (PackedCpuDense(cpu_isa), TorchDense()):
        got = backend.rows(backend.prepare(w), ids, k)
        assert got.shape == (37, k) and got.is_contiguous()
        assert torch.equal(got, w[ids]), backend.name


def test_onednn_has_no_rows():
    from punica_x.ops.dense import OneDnnDense, has_rows

    assert has_rows(TorchDense()) and has_rows(PackedCpuDense())
    assert not has_rows(OneDnnDense())
