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


def _regions(g, sizes):
    """Tensors of `sizes` elements (bf16) and their [R, 2] (address, bytes) regions."""
    ts = [torch.randn(n, generator=g).to(torch.bfloat16) for n in sizes]
    return ts, torch.tensor([[t.data_ptr(), t.nbytes] for t in ts], dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "n"), [(32, 576, 960), (1, 100, 50), (9, 7, 1)])
def test_prefetch_changes_no_result(dtype, m, k, n, cpu_isa):
    """The prefetch hint (LoRA weights pulled in during the GEMM) is only a hint: bit for bit
    the same output, with regions more or fewer than the GEMM's steps, empty ones included."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    cpu = PackedCpuDense(cpu_isa)
    packed = cpu.prepare((torch.randn(n, k, generator=g) * k**-0.5).to(dtype))
    x = torch.randn(m, k, generator=g).to(dtype)
    want = cpu.forward(x, packed, n, None)
    for sizes in ([], [0], [1], [5000, 0, 33, 70000], [300] * 64):
        keep, spans = _regions(g, sizes)
        assert torch.equal(cpu.forward(x, packed, n, None, spans.reshape(-1, 2)), want), sizes


@pytest.mark.parametrize("parts", [1, 2, 3, 20, 1000])
@pytest.mark.parametrize("step", [1, 3, 64])
def test_prefetch_parts_cover_every_line_once(parts, step, cpu_isa):
    """Split over a GEMM's work items (parts), the regions' cache lines are each prefetched
    once, in order: unaligned starts, lengths that end mid-line, empty regions, and more parts
    than lines."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    ext = PackedCpuDense(cpu_isa).ext
    keep, spans = _regions(g, [1, 31, 32, 33, 0, 4097, 1000])
    spans[1, 0] += 2  # an odd start inside the tensor
    spans[1, 1] -= 2
    want = []
    for start, size in spans.tolist():
        if size:
            want += range(start & ~63, start + size, 64)
    assert ext.prefetch_walk(spans, parts, step).tolist() == want


def test_an_absurd_prefetch_hint_is_capped(cpu_isa):
    """8 regions of 2^40 bytes (2^37 lines, past int32) over a GEMM of 2 x 32 steps: at most
    kMaxLinesPerStep (64) lines a step are issued, the rest left unfetched; without the cap
    the count overflowed, or the GEMM walked 2^31 lines a step (minutes, not microseconds).
    Prefetches never fault, so the addresses past x need not be mapped."""
    cpu = PackedCpuDense(cpu_isa)
    packed = cpu.prepare(torch.randn(96, 64))
    x = torch.randn(4, 64)
    spans = torch.tensor([[x.data_ptr(), 1 << 40]] * 8, dtype=torch.int64)
    assert torch.equal(cpu.forward(x, packed, 96, None, spans), cpu.forward(x, packed, 96, None))


def test_prefetch_hint_is_checked(cpu_isa):
    ext = PackedCpuDense(cpu_isa).ext
    packed = ext.pack(torch.randn(96, 32))
    x, y = torch.randn(4, 32), torch.empty(4, 96)
    bad = (
        torch.zeros(2, 2),  # float
        torch.zeros(2, 2, dtype=torch.int32),
        torch.zeros(4, dtype=torch.int64),  # 1-D
        torch.zeros(2, 3, dtype=torch.int64),
        torch.zeros(2, 4, dtype=torch.int64)[:, ::2],  # strided
    )
    for spans in bad:
        with pytest.raises(RuntimeError, match=r"prefetch must be a contiguous \[regions, 2\]"):
            ext.gemm(y, x, packed, 96, None, spans)
    for size in (-1, 1 << 41):
        spans = torch.tensor([[x.data_ptr(), 64], [x.data_ptr(), size]], dtype=torch.int64)
        with pytest.raises(RuntimeError, match=f"prefetch region 1 has {size} bytes"):
            ext.gemm(y, x, packed, 96, None, spans)
    with pytest.raises(RuntimeError, match="parts and step must be >= 1"):
        ext.prefetch_walk(torch.zeros(0, 2, dtype=torch.int64), 0, 1)


def test_only_the_packed_backend_takes_prefetch():
    from punica_x.ops.dense import OneDnnDense, prefetches

    assert prefetches(PackedCpuDense())
    assert not prefetches(TorchDense()) and not prefetches(OneDnnDense())
