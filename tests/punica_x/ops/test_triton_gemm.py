"""The batch-invariant Triton GEMM (ops.triton_gemm): the reference's values, and a row's
bits the same alone and anywhere in any batch. On a CPU through Triton's interpreter."""

import pytest
import torch
from triton_interpreter import device, mended, skip_without_triton

pytestmark = pytest.mark.triton
skip_without_triton()
from punica_x.ops.triton_gemm import TritonDense, gemm  # noqa: E402

N, K = 80, 160  # neither a multiple of the 64-wide tiles: the masked edges run


def _weights(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=g) * K**-0.5).to(dtype)
    return w.to(device()), torch.randn(N, generator=g).to(dtype).to(device())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_reference(dtype, with_bias):
    w, bias = _weights(dtype)
    x = torch.randn(70, K).to(dtype).to(device())
    with mended():
        y = gemm(x, w, bias if with_bias else None)
    ref = x.double() @ w.double().t() + (bias.double() if with_bias else 0)
    assert y.dtype == dtype and y.shape == (70, N)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_has_the_same_bits_alone_and_anywhere_in_a_batch(dtype):
    w, bias = _weights(dtype, seed=1)
    batch = torch.randn(70, K).to(dtype).to(device())
    with mended():
        full = gemm(batch, w, bias)
        for m in (1, 3, 17, 64, 65, 70):
            part = gemm(batch[:m], w, bias)
            assert torch.equal(part, full[:m]), m
        for row in (0, 5, 63, 64, 69):
            alone = gemm(batch[row : row + 1], w, bias)
            assert torch.equal(alone[0], full[row]), row
            moved = torch.cat([batch[row + 1 :], batch[: row + 1]])  # the row now last
            assert torch.equal(gemm(moved, w, bias)[-1], full[row]), row


def test_the_backend_reads_rows_back_and_refuses_mismatches():
    w, _ = _weights(torch.float32)
    backend = TritonDense()
    prepared = backend.prepare(w)
    ids = torch.tensor([3, 0, 79], device=w.device)
    assert torch.equal(backend.rows(prepared, ids, K), w[ids])
    x = torch.randn(2, K, device=w.device)
    with pytest.raises(ValueError, match="one dtype"):
        gemm(x.bfloat16(), w)
    with pytest.raises(ValueError, match="one dtype"):
        gemm(x.to(torch.float64), w.to(torch.float64))
    with pytest.raises(ValueError, match=r"x is \[2, 159\]"):
        gemm(x[:, 1:], w)
    assert gemm(x[:0], w).shape == (0, N)
