"""Fused CPU layers against their PyTorch reference on fresh random inputs."""

import os

import pytest
import torch

from punica_x.ops.fused import CpuFused, TorchFused

REF = TorchFused()


@pytest.fixture
def cpu(cpu_isa):
    return CpuFused(cpu_isa)


def gen():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("hidden", [64, 576, 1000])
def test_rms_norm_and_residual_add(cpu, rows, hidden):
    g = gen()
    x = torch.randn(rows, hidden, generator=g) * 3
    w = torch.randn(hidden, generator=g)
    torch.testing.assert_close(
        cpu.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5
    )
    strided = torch.randn(rows, hidden + 7, generator=g)[:, 3 : 3 + hidden]
    torch.testing.assert_close(cpu.rms_norm(strided, w, 1e-6), REF.rms_norm(strided, w, 1e-6))
    r1, r2 = torch.randn(rows, hidden, generator=g), None
    r2 = r1.clone()
    out = cpu.add_rms_norm(x, r1, w, 1e-5)
    ref = REF.add_rms_norm(x, r2, w, 1e-5)
    torch.testing.assert_close(r1, r2)  # the residual stream is updated in place
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# head_dim 40: half a head (20) is not a whole vector, so a scalar tail follows the vectors
@pytest.mark.parametrize(("heads", "head_dim"), [(9, 64), (3, 64), (4, 32), (2, 40)])
def test_rope_in_place_on_a_column_slice(cpu, heads, head_dim):
    g = gen()
    rows, width = 7, 1000
    qkv = torch.randn(rows, width, generator=g)
    positions = torch.randint(0, 300, (rows,), generator=g)
    ang = torch.rand(400, head_dim // 2, generator=g) * 6
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    ours, ref = qkv.clone(), qkv.clone()
    lo, hi = 100, 100 + heads * head_dim
    cpu.rope_(ours[:, lo:hi], heads, head_dim, positions, cos, sin)
    REF.rope_(ref[:, lo:hi], heads, head_dim, positions, cos, sin)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(ours[:, :lo], qkv[:, :lo]) and torch.equal(ours[:, hi:], qkv[:, hi:])


@pytest.mark.parametrize("inter", [1536, 1000, 7])  # vector body and scalar tail
def test_silu_and_mul(cpu, inter):
    g = gen()
    gate_up = torch.randn(9, 2 * inter, generator=g) * 4
    gate_up[0, :inter] = torch.linspace(-120, 120, inter)  # past exp's clamping range
    torch.testing.assert_close(
        cpu.silu_and_mul(gate_up), REF.silu_and_mul(gate_up), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("inter", [1536, 1000, 7])
def test_gelu_tanh_and_mul(cpu, inter):
    """Gemma's gelu_pytorch_tanh, against F.gelu(approximate="tanh") and against float64,
    far tails included. atol 1e-5 against torch: below x ~ -4.5 torch's 0.5 x (1 + tanh(y))
    cancels to 0 in float32 where the value is ~1e-6 (ours, x / (1 + exp(-2y)), keeps it)."""
    g = gen()
    gate_up = torch.randn(9, 2 * inter, generator=g) * 4
    gate_up[0, :inter] = torch.linspace(-120, 120, inter)
    ours = cpu.gelu_tanh_and_mul(gate_up)
    torch.testing.assert_close(ours, REF.gelu_tanh_and_mul(gate_up), rtol=1e-5, atol=1e-5)
    exact = REF.gelu_tanh_and_mul(gate_up.double())
    torch.testing.assert_close(ours.double(), exact, rtol=1e-5, atol=1e-7)


def test_inputs_are_checked(cpu):
    with pytest.raises(RuntimeError, match="position 500 outside the table"):
        cpu.rope_(
            torch.zeros(1, 64), 1, 64, torch.tensor([500]), torch.zeros(10, 64), torch.zeros(10, 64)
        )
    with pytest.raises(RuntimeError, match="x must be"):
        cpu.rms_norm(torch.zeros(2, 10), torch.ones(12), 1e-5)
    assert isinstance(cpu, CpuFused) and cpu.ext.__file__.endswith(".so")
