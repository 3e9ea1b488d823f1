"""The batch-invariant Triton RMSNorm (ops.triton_norm): the reference's values, a row's bits
the same alone and in any batch, and the residual add in place. Through Triton's interpreter
on a CPU."""

import pytest
import torch
from triton_interpreter import device, mended, skip_without_triton

pytestmark = pytest.mark.triton
skip_without_triton()
from punica_x.ops.fused import TorchFused  # noqa: E402
from punica_x.ops.triton_norm import TritonFused, rms_norm  # noqa: E402

H = 96  # not a power of two: the masked lanes run


def _data(dtype, rows=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, H, generator=g) * 3).to(dtype).to(device())
    res = torch.randn(rows, H, generator=g).to(dtype).to(device())
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(device())
    return x, res, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_torch_reference(dtype):
    x, res, w = _data(dtype)
    ref = TorchFused()
    ours = TritonFused(ref)
    with mended():
        y = ours.rms_norm(x, w, 1e-5)
        r_ours = res.clone()
        y_add = ours.add_rms_norm(x, r_ours, w, 1e-5)
    r_ref = res.clone()
    y_add_ref = ref.add_rms_norm(x, r_ref, w, 1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y, ref.rms_norm(x, w, 1e-5), atol=tol, rtol=tol)
    assert torch.equal(r_ours, r_ref)  # the residual stream: one rounding of res + x
    torch.testing.assert_close(y_add, y_add_ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_has_the_same_bits_alone_and_in_any_batch(dtype):
    x, res, w = _data(dtype, seed=1)
    with mended():
        full = rms_norm(x, w, 1e-6)
        full_res = res.clone()
        full_add = rms_norm(x, w, 1e-6, full_res)
        for row in (0, 7, 39):
            assert torch.equal(rms_norm(x[row : row + 1], w, 1e-6)[0], full[row])
            alone_res = res[row : row + 1].clone()
            alone = rms_norm(x[row : row + 1], w, 1e-6, alone_res)
            assert torch.equal(alone[0], full_add[row])
            assert torch.equal(alone_res[0], full_res[row])


def test_an_empty_batch_and_a_bad_residual():
    x, res, w = _data(torch.float32, rows=4)
    with mended():
        assert rms_norm(x[:0], w, 1e-5).shape == (0, H)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(x, w, 1e-5, res.t().contiguous().t())
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(x, w, 1e-5, res[:2])
