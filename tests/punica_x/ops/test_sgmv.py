"""SGMV kernels against the pure-PyTorch reference on fresh random inputs.

The grid covers adapter popularity x rank x batch x rows without an adapter (Punica's test
axes); more tests cover several slices in one launch, layer offsets, strided outputs and the
binding's input checks.
"""

import os
import random

import pytest
import torch

from punica_x.ops.sgmv import (
    CompiledBackend,
    SgmvWeights,
    add_lora_sgmv,
    cpu_backend,
    get_backend,
    sgmv_expand,
    sgmv_shrink,
)
from punica_x.workloads import POPULARITIES, assign_adapters, segment_lengths

REF = get_backend("cpu", "torch_ref")


def compiled(isa: str | None = None):
    return cpu_backend(isa)


def make_weights(rng, seg_lens, slice_ranks, h_in, h_out, layers, device="cpu"):
    """Random adapters for the given segments; slice_ranks[s] is None for a base-model segment."""
    seg, a, b = [0], [], []
    for n, ranks in zip(seg_lens, slice_ranks):
        seg.append(seg[-1] + n)
        if ranks is None:
            a.append(None)
            b.append(None)
            continue
        a.append(torch.randn(layers, sum(ranks), h_in, generator=rng) * 0.1)
        b.append(torch.randn(layers, sum(r * h for r, h in zip(ranks, h_out)), generator=rng) * 0.1)
    ranks = [r if r is not None else [0] * len(h_out) for r in slice_ranks]
    return SgmvWeights.build(seg, a, b, ranks, h_out, device)


def cast(w: SgmvWeights, dtype: torch.dtype) -> SgmvWeights:
    """The same segments with every adapter's tensors in `dtype` (on the CPU)."""
    return SgmvWeights.build(
        w.seg_host,
        [None if t is None else t.to(dtype) for t in w.a],
        [None if t is None else t.to(dtype) for t in w.b],
        w.ranks_host,
        w.h_out,
        "cpu",
    )


def fresh_generator():
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator().manual_seed(seed), seed


def with_base_rows(lens, pyrng):
    """Insert a few segments without adapter (base-model rows) at random places."""
    out = [(n, True) for n in lens]
    for _ in range(pyrng.randint(1, 3)):
        out.insert(pyrng.randint(0, len(out)), (pyrng.randint(1, 3), False))
    return out


@pytest.mark.parametrize("base_rows", [False, True], ids=["all-lora", "base-rows"])
@pytest.mark.parametrize("batch", [1, 7, 32, 64])
@pytest.mark.parametrize("rank", [8, 16, 32, 64])
@pytest.mark.parametrize("popularity", POPULARITIES)
def test_sgmv_matches_reference(popularity, rank, batch, base_rows, cpu_isa):
    gen, seed = fresh_generator()
    pyrng = random.Random(seed)
    lens = segment_lengths(assign_adapters(popularity, batch, pyrng))
    segs = with_base_rows(lens, pyrng) if base_rows else [(n, True) for n in lens]
    h_in, h_out, layers = pyrng.choice([64, 576, 1000]), pyrng.choice([64, 576, 1000]), 3
    w = make_weights(
        gen,
        [n for n, _ in segs],
        [[rank] if lora else None for _, lora in segs],
        h_in,
        [h_out],
        layers,
    )
    rows = w.seg_host[-1]
    x = torch.randn(rows, h_in, generator=gen)
    y0 = torch.randn(rows, h_out, generator=gen)
    layer = pyrng.randrange(layers)

    v_ref = sgmv_shrink(x, w, layer, backend=REF)
    v_our = sgmv_shrink(x, w, layer, backend=compiled(cpu_isa))
    torch.testing.assert_close(
        v_our, v_ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"seed={seed}: {m}"
    )

    y_ref = sgmv_expand(y0.clone(), v_ref, w, layer, backend=REF)
    y_our = sgmv_expand(y0.clone(), v_ref, w, layer, backend=compiled(cpu_isa))
    torch.testing.assert_close(
        y_our, y_ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"seed={seed}: {m}"
    )

    base = [
        i
        for s, (_, lora) in enumerate(segs)
        if not lora
        for i in range(w.seg_host[s], w.seg_host[s + 1])
    ]
    assert torch.equal(y_our[base], y0[base]), "rows without an adapter must be left untouched"


def test_sgmv_several_slices_with_missing_modules(cpu_isa):
    """q|k|v in one launch, adapters with different ranks and some slices not targeted."""
    gen, seed = fresh_generator()
    h_in, h_out = 576, [576, 192, 192]
    slice_ranks = [[8, 8, 8], [16, 0, 16], None, [4, 4, 0], [64, 64, 64]]
    w = make_weights(gen, [3, 1, 2, 5, 1], slice_ranks, h_in, h_out, layers=4)
    rows = w.seg_host[-1]
    x = torch.randn(rows, h_in, generator=gen)
    y = torch.randn(rows, sum(h_out), generator=gen)
    for layer in range(4):
        y_ref = add_lora_sgmv(y.clone(), x, w, layer, backend=REF)
        y_our = add_lora_sgmv(y.clone(), x, w, layer, backend=compiled(cpu_isa))
        torch.testing.assert_close(
            y_our, y_ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"seed={seed}: {m}"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_segments_with_wide_outputs_and_odd_ranks(dtype, cpu_isa):
    """One-row segments (the distinct case) stream B in column items of up to 2048: outputs
    wider than one item and not a multiple of the vector width, odd ranks, two slices."""
    gen, seed = fresh_generator()
    h_in, h_out = 100, [4100, 33]
    w32 = make_weights(gen, [1, 1, 1, 2], [[5, 3], [16, 16], None, [1, 7]], h_in, h_out, 2)
    w = cast(w32, dtype)
    rows = w.seg_host[-1]
    x = torch.randn(rows, h_in, generator=gen).to(dtype)
    y = torch.randn(rows, sum(h_out), generator=gen).to(dtype)
    y_ref = add_lora_sgmv(y.float().clone(), x.float(), w32, 1, backend=REF)
    y_our = add_lora_sgmv(y.clone(), x, w, 1, backend=compiled(cpu_isa))
    tol = 1e-4 if dtype == torch.float32 else 8e-3  # bf16: one rounding of each output
    torch.testing.assert_close(
        y_our.float(), y_ref, rtol=tol, atol=tol, msg=lambda m: f"seed={seed}: {m}"
    )
    assert torch.equal(y_our[2], y[2])  # the row without an adapter is untouched


def test_sgmv_expand_into_strided_view(cpu_isa):
    """y may be a column slice of a wider tensor (a fused projection output)."""
    gen, _ = fresh_generator()
    w = make_weights(gen, [2, 3], [[16], [8]], 128, [64], layers=1)
    x = torch.randn(5, 128, generator=gen)
    wide = torch.randn(5, 200, generator=gen)
    ref = wide.clone()
    add_lora_sgmv(ref[:, 100:164], x, w, backend=REF)
    add_lora_sgmv(wide[:, 100:164], x, w, backend=compiled(cpu_isa))
    torch.testing.assert_close(wide, ref, rtol=1e-4, atol=1e-4)


def test_sgmv_empty_batch_and_no_adapters(cpu_isa):
    w = SgmvWeights.build([0], [], [], [], [64], "cpu")
    assert add_lora_sgmv(
        torch.zeros(0, 32), torch.zeros(0, 32), w, backend=compiled(cpu_isa)
    ).shape == (
        0,
        32,
    )
    w = make_weights(torch.Generator(), [4], [None], 32, [64], layers=1)
    y = torch.ones(4, 64)
    add_lora_sgmv(y, torch.randn(4, 32), w, backend=compiled(cpu_isa))
    assert torch.equal(y, torch.ones(4, 64))


def test_compiled_kernel_is_the_one_running():
    """No silent fallback: on CPU the default backend is the compiled C++ extension."""
    assert os.environ.get("PUNICA_X_SGMV_BACKEND", "") in ("", "cpu")
    backend = get_backend("cpu")
    assert isinstance(backend, CompiledBackend) and backend.name == "cpu"
    assert backend.module.__file__.endswith(".so")
    assert not backend.module.has_cuda()


def test_each_isa_build_is_what_it_says(cpu_isa):
    assert compiled(cpu_isa).module.isa() == cpu_isa


def test_binding_checks_inputs():
    ext = compiled().module
    gen, _ = fresh_generator()
    w = make_weights(gen, [2, 2], [[16], [16]], 64, [32], layers=2)
    x = torch.randn(4, 64)
    v = torch.zeros(4, 16)
    with pytest.raises(RuntimeError, match="v must be float32"):
        ext.sgmv_shrink(v.double(), x, w.a_ptr, w.ranks, w.seg, 0, w.max_rows, w.max_rank)
    with pytest.raises(RuntimeError, match="x must be 2-D"):
        ext.sgmv_shrink(v, x[None], w.a_ptr, w.ranks, w.seg, 0, w.max_rows, w.max_rank)
    with pytest.raises(RuntimeError, match=r"x must have contiguous rows"):
        ext.sgmv_shrink(
            v, torch.randn(64, 4).t(), w.a_ptr, w.ranks, w.seg, 0, w.max_rows, w.max_rank
        )
    with pytest.raises(RuntimeError, match="seg must be non-decreasing"):
        bad = torch.tensor([0, 3, 1], dtype=torch.int32)
        ext.sgmv_shrink(v, x, w.a_ptr, w.ranks, bad, 0, 4, w.max_rank)
    with pytest.raises(RuntimeError, match="segments must lie in"):
        bad = torch.tensor([0, 2, 9], dtype=torch.int32)
        ext.sgmv_shrink(v, x, w.a_ptr, w.ranks, bad, 0, 9, w.max_rank)
    with pytest.raises(RuntimeError, match="w_ptr must have shape"):
        ext.sgmv_shrink(v, x, w.a_ptr[:1], w.ranks, w.seg, 0, w.max_rows, w.max_rank)
    with pytest.raises(RuntimeError, match="v has 8 columns"):
        ext.sgmv_shrink(torch.zeros(4, 8), x, w.a_ptr, w.ranks, w.seg, 0, w.max_rows, 16)
    with pytest.raises(RuntimeError, match="has rank 16 > max_rank 8"):
        ext.sgmv_shrink(v, x, w.a_ptr, w.ranks, w.seg, 0, w.max_rows, 8)
    with pytest.raises(RuntimeError, match="y has 16 columns"):
        ext.sgmv_expand(
            torch.zeros(4, 16), v, w.b_ptr, w.ranks, w.seg, [32], 0, w.max_rows, w.max_rank
        )
    with pytest.raises(RuntimeError, match="h_out has 2 slices"):
        ext.sgmv_expand(
            torch.zeros(4, 64), v, w.b_ptr, w.ranks, w.seg, [32, 32], 0, w.max_rows, w.max_rank
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_launch_matches_add_lora_and_the_reference(dtype, cpu_isa):
    """SgmvWeights.launch(backend): the compiled backend's C++ launch object (metadata checked
    once) computes exactly what add_lora computes, at every layer, and the torch_ref launch
    what the reference does; one launch per weights and backend."""
    gen, seed = fresh_generator()
    h_in, h_out = 576, [576, 192, 192]
    slice_ranks = [[8, 8, 8], [16, 0, 16], None, [4, 4, 0], [16, 16, 16], [16, 16, 16]]
    w = make_weights(gen, [3, 1, 2, 5, 1, 1], slice_ranks, h_in, h_out, layers=3)
    w = cast(w, dtype)
    backend = compiled(cpu_isa)
    launch = w.launch(backend)
    assert w.launch(backend) is launch and w.launch(REF) is not launch
    rows = w.seg_host[-1]
    x = torch.randn(rows, h_in, generator=gen).to(dtype)
    y = torch.randn(rows, sum(h_out), generator=gen).to(dtype)
    for layer in range(3):
        ours, theirs, ref = y.clone(), y.clone(), y.clone()
        launch(ours, x, torch.zeros(rows, w.max_rank), layer)
        backend.add_lora(theirs, x, torch.zeros(rows, w.max_rank), w, layer)
        w.launch(REF)(ref, x, torch.zeros(rows, w.max_rank), layer)
        assert torch.equal(ours, theirs), f"seed={seed} layer {layer}"
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(
            ours.float(), ref.float(), rtol=tol, atol=tol, msg=lambda m: f"seed={seed}: {m}"
        )


@pytest.mark.parametrize("batch", [1, 7, 32, 64])
@pytest.mark.parametrize("popularity", ["distinct", "uniform", "identical"])
def test_bfloat16_weights_with_float32_x_match_the_reference(popularity, batch, cpu_isa):
    """LoraConfig.dtype bfloat16 under a float32 model: the kernels read the adapters' bf16
    weights, widen them as loaded and compute in float32, so shrink, expand, add_lora and the
    C++ launch give the reference's result on the same bf16 weights (float32 tolerance, not
    bf16's), one-row and multi-row segments, several slices, base rows untouched."""
    gen, seed = fresh_generator()
    pyrng = random.Random(seed)
    lens = segment_lengths(assign_adapters(popularity, batch, pyrng))
    segs = with_base_rows(lens, pyrng)
    h_in, h_out = pyrng.choice([64, 576, 1000]), [576, 192, 200]
    ranks = [[16, 8, 16] if lora else None for _, lora in segs]
    w = cast(make_weights(gen, [n for n, _ in segs], ranks, h_in, h_out, 3), torch.bfloat16)
    assert w.weight_dtype == torch.bfloat16
    rows, layer, backend = w.seg_host[-1], pyrng.randrange(3), compiled(cpu_isa)
    x = torch.randn(rows, h_in, generator=gen)
    y0 = torch.randn(rows, sum(h_out), generator=gen)
    close = dict(rtol=1e-4, atol=1e-4, msg=lambda m: f"seed={seed}: {m}")

    v_ref = sgmv_shrink(x, w, layer, backend=REF)
    torch.testing.assert_close(sgmv_shrink(x, w, layer, backend=backend), v_ref, **close)
    y_ref = sgmv_expand(y0.clone(), v_ref, w, layer, backend=REF)
    y_our = sgmv_expand(y0.clone(), v_ref, w, layer, backend=backend)
    torch.testing.assert_close(y_our, y_ref, **close)
    for run in (
        lambda y: backend.add_lora(y, x, torch.zeros(rows, w.max_rank), w, layer),
        lambda y: w.launch(backend)(y, x, torch.zeros(rows, w.max_rank), layer),
    ):
        y = y0.clone()
        run(y)
        torch.testing.assert_close(y, y_ref, **close)
    base = [i for s, r in enumerate(ranks) if r is None for i in range(*w.seg_host[s : s + 2])]
    assert torch.equal(y_our[base], y0[base]), "rows without an adapter must be left untouched"


def test_weights_of_another_dtype_are_refused_where_no_kernel_takes_them(cpu_isa):
    """Only float32 x reads bf16 weights: bf16 x with float32 weights, or float16 weights, is
    refused by the binding with both dtypes named (the kernels would read the bytes wrongly);
    one launch's adapters share a dtype."""
    gen, _ = fresh_generator()
    w32 = make_weights(gen, [2, 2], [[16], [16]], 64, [32], layers=2)
    ext = compiled(cpu_isa).module
    x, v = torch.randn(4, 64).bfloat16(), torch.zeros(4, 16)
    args = (w32.a_ptr, w32.ranks, w32.seg, 0, w32.max_rows, w32.max_rank)
    with pytest.raises(RuntimeError, match="weights of dtype Float with x of dtype BFloat16"):
        ext.sgmv_shrink(v, x, *args, torch.float32)
    with pytest.raises(RuntimeError, match="weights of dtype Half with x of dtype Float"):
        ext.sgmv_shrink(v, x.float(), *args, torch.float16)
    with pytest.raises(RuntimeError, match="weights of dtype Float with x of dtype BFloat16"):
        ext.sgmv_expand(x.clone(), v, w32.b_ptr, w32.ranks, w32.seg, [32], 0, 2, 16, torch.float32)
    launch = ext.CpuLaunch(
        w32.a_ptr, w32.b_ptr, w32.ranks, w32.seg, [32], 2, 16, 2, 64, None, torch.float32
    )
    with pytest.raises(RuntimeError, match="weights of dtype Float with x of dtype BFloat16"):
        launch.add_lora(torch.zeros(4, 32).bfloat16(), x, v, 0)
    a16, a32 = torch.zeros(2, 16, 64).bfloat16(), torch.zeros(2, 16, 64)
    b16, b32 = torch.zeros(2, 16 * 32).bfloat16(), torch.zeros(2, 16 * 32)
    with pytest.raises(ValueError, match="share one dtype"):
        SgmvWeights.build([0, 1, 2], [a16, a32], [b16, b32], [[16], [16]], [32], "cpu")
    with pytest.raises(ValueError, match="share one dtype"):
        SgmvWeights.build([0, 1], [a16], [b32], [[16]], [32], "cpu")


def test_launch_keeps_its_weights_alive():
    """The launch points into the adapters' tensors: it holds them, so it stays valid when
    the SgmvWeights it came from is gone."""
    import gc

    gen, _ = fresh_generator()
    w = make_weights(gen, [2, 3], [[16], [8]], 64, [96], layers=2)
    x, y = torch.randn(5, 64, generator=gen), torch.randn(5, 96, generator=gen)
    want = add_lora_sgmv(y.clone(), x, w, 1, backend=REF)
    launch = w.launch(compiled())
    del w
    gc.collect()
    torch.randn(1 << 20)  # reuse freed memory, if any was freed
    got = y.clone()
    launch(got, x, torch.zeros(5, 16), 1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_launch_bounds_the_layer_by_its_adapters():
    """The kernels offset the weights' addresses by the layer: a layer past the adapters'
    tensors is refused, not read; a launch without adapters reads nothing at any layer."""
    gen, _ = fresh_generator()
    w = make_weights(gen, [2, 2], [[16], None], 64, [32], layers=3)
    launch = w.launch(compiled())
    x, y, v = torch.randn(4, 64), torch.zeros(4, 32), torch.zeros(4, 16)
    launch(y, x, v, 2)
    with pytest.raises(RuntimeError, match="layer must be in 0..2, got 3"):
        launch(y, x, v, 3)
    none = make_weights(gen, [4], [None], 64, [32], layers=1)
    y = torch.ones(4, 32)
    none.launch(compiled())(y, x, torch.zeros(4, 1), 1000)
    assert torch.equal(y, torch.ones(4, 32))


def test_launch_keeps_its_own_copy_of_the_metadata():
    """Segments changed after the launch was made (they were checked then) change nothing."""
    gen, _ = fresh_generator()
    w = make_weights(gen, [2, 2], [[16], [16]], 64, [32], layers=1)
    x = torch.randn(4, 64, generator=gen)
    want = add_lora_sgmv(torch.zeros(4, 32), x, w, 0, backend=REF)
    launch = w.launch(compiled())
    w.seg[1] = 9  # past the rows: the launch would read and write out of bounds
    w.ranks.fill_(1 << 20)
    got = torch.zeros(4, 32)
    launch(got, x, torch.zeros(4, 16), 0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_launch_refuses_adapters_of_different_widths_or_depths():
    """One x and one layer index serve every segment: the weights builder refuses adapters
    that differ in either (for every backend, before any launch is made)."""
    gen, _ = fresh_generator()
    for other in (dict(h_in=32, layers=2), dict(h_in=64, layers=3)):
        a = make_weights(gen, [1], [[16]], 64, [32], layers=2)
        b = make_weights(gen, [1], [[16]], other["h_in"], [32], layers=other["layers"])
        with pytest.raises(ValueError, match="must share layers and h_in"):
            SgmvWeights.build([0, 1, 2], [*a.a, *b.a], [*a.b, *b.b], [[16], [16]], [32], "cpu")


def test_launch_checks_its_metadata_once_and_its_tensors_per_call():
    ext = compiled().module
    gen, _ = fresh_generator()
    w = make_weights(gen, [2, 2], [[16], [16]], 64, [32], layers=2)

    def make(**change):
        args = dict(
            a_ptr=w.a_ptr,
            b_ptr=w.b_ptr,
            ranks=w.ranks,
            seg=w.seg,
            h_out=[32],
            max_rows=w.max_rows,
            max_rank=w.max_rank,
            layers=2,
            h_in=64,
            keep=(w.a, w.b),
        )
        return ext.CpuLaunch(**{**args, **change})

    bad_metadata = {
        "seg must be non-decreasing": dict(seg=torch.tensor([0, 3, 1], dtype=torch.int32)),
        "seg must be 1-D": dict(seg=torch.zeros(0, dtype=torch.int32)),
        "w_ptr must have shape": dict(a_ptr=w.a_ptr[:1]),
        "w_ptr must be Long": dict(b_ptr=w.b_ptr.int()),
        "has rank 16 > max_rank 8": dict(max_rank=8),
        "has 2 rows > max_rows 1": dict(max_rows=1),
        "ranks must be >= 0": dict(ranks=-w.ranks),
        "h_out has 2 slices": dict(h_out=[32, 32]),
        r"h_out\[0\] must be in 1..2\^31-1": dict(h_out=[0]),
        r"h_out\[0\] must be in": dict(h_out=[1 << 40]),
        "layers must be in": dict(layers=-1),
        "layers must be in ": dict(layers=1 << 40),
        "h_in must be in": dict(h_in=-1),
        "h_in must be in ": dict(h_in=1 << 40),
    }
    for message, change in bad_metadata.items():
        with pytest.raises(RuntimeError, match=message):
            make(**change)
    with pytest.raises(TypeError):
        make(h_out=[float("nan")])

    launch = make().add_lora
    x, y, v = torch.randn(4, 64), torch.zeros(4, 32), torch.zeros(4, 16)
    bad_calls = {
        "x must be 2-D": (y, x[None], v, 0),
        "x must have contiguous rows": (y, torch.randn(64, 4).t(), v, 0),
        "y must be x's dtype": (y.bfloat16(), x, v, 0),
        "x must be float32 or bfloat16": (y.double(), x.double(), v, 0),
        "v must be float32": (y, x, v.double(), 0),
        "must have the same rows": (y[:3], x, v, 0),
        "segments must lie in": (y[:3], x[:3], v[:3], 0),
        "y has 16 columns": (torch.zeros(4, 16), x, v, 0),
        "v has 8 columns": (y, x, torch.zeros(4, 8), 0),
        "layer must be in 0..1, got -1": (y, x, v, -1),
        "layer must be in 0..1, got 2": (y, x, v, 2),
        "layer must be in 0..1, got 1099511627776": (y, x, v, 1 << 40),
        "x must have the adapters' 64 columns, got 65": (y, torch.randn(4, 65), v, 0),
        "x must have the adapters' 64 columns, got 32": (y, torch.randn(4, 32), v, 0),
    }
    for message, args in bad_calls.items():
        with pytest.raises(RuntimeError, match=message):
            launch(*args)
    launch(y, x, v, 1)  # and the launch still works
    assert torch.equal(y, add_lora_sgmv(torch.zeros(4, 32), x, w, 1, backend=compiled()))


def test_weights_builder_checks_shapes():
    a = torch.zeros(2, 16, 64)
    with pytest.raises(ValueError, match="b must be contiguous"):
        SgmvWeights.build([0, 1], [a], [torch.zeros(2, 100)], [[16]], [32], "cpu")
    with pytest.raises(ValueError, match="a must be contiguous"):
        SgmvWeights.build([0, 1], [a], [torch.zeros(2, 16 * 32)], [[8]], [32], "cpu")
    with pytest.raises(ValueError, match="both be given"):
        SgmvWeights.build([0, 1], [a], [None], [[16]], [32], "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("batch", [1, 7, 32, 64])
def test_sgmv_cuda_matches_reference(popularity, batch, dtype):
    gen, seed = fresh_generator()
    pyrng = random.Random(seed)
    lens = segment_lengths(assign_adapters(popularity, batch, pyrng))
    segs = with_base_rows(lens, pyrng)
    h_out = [4096, 1024]
    ranks = [[16, 8] if lora else None for _, lora in segs]
    w_cpu = make_weights(gen, [n for n, _ in segs], ranks, 4096, h_out, layers=2)
    dev = torch.device("cuda")
    w = SgmvWeights.build(
        list(w_cpu.seg_host),
        [None if a is None else a.to(dev, dtype) for a in w_cpu.a],
        [None if b is None else b.to(dev, dtype) for b in w_cpu.b],
        [list(r) for r in w_cpu.ranks_host],
        h_out,
        dev,
    )
    rows = w.seg_host[-1]
    x = torch.randn(rows, 4096, device=dev, dtype=dtype)
    y = torch.randn(rows, sum(h_out), device=dev, dtype=dtype)
    y_ref = add_lora_sgmv(y.clone(), x, w, 1, backend=REF)
    y_our = add_lora_sgmv(y.clone(), x, w, 1, backend=get_backend(dev))
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(y_our, y_ref, rtol=tol, atol=tol, msg=lambda m: f"seed={seed}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("h_in", [4096, 14336, 136])
@pytest.mark.parametrize("layout", ["aligned", "x-unaligned", "a-unaligned"])
@pytest.mark.parametrize("lens", [[1] * 7, [1, 3, 9, 2, 17, 1, 8]], ids=["one-row", "multi-row"])
def test_sgmv_cuda_shrink_writes_every_value_expand_reads(dtype, h_in, layout, lens):
    """Segments of one row (the distinct-adapter decode case) and of several (a hot adapter's
    rows over several row tiles, partial tiles), base rows between them, rank sums of 48 over
    three slices and 8 over one. The workspace starts as NaN, as add_lora leaves it unzeroed
    when the shrink writes (not adds) every value expand reads: a value it missed would show.
    x out of 16-byte units takes the split-K kernel (zeroed v); an adapter's A out of them
    takes the write-once kernel's scalar loop."""
    gen, seed = fresh_generator()
    dev = torch.device("cuda")
    h_out = [256, 64, 64]
    ranks = [[16, 16, 16], None, [8, 0, 0], [16, 16, 16], None, [16, 16, 16], [4, 2, 2]]
    w_cpu = make_weights(gen, lens, ranks, h_in, h_out, layers=2)
    a = [None if t is None else t.to(dev, dtype) for t in w_cpu.a]
    if layout == "a-unaligned":  # one element past a 16-byte boundary
        buf = torch.empty(a[0].numel() + 1, device=dev, dtype=dtype)
        buf[1:] = a[0].flatten()
        a[0] = buf[1:].view_as(a[0])
    b = [None if t is None else t.to(dev, dtype) for t in w_cpu.b]
    w = SgmvWeights.build(
        list(w_cpu.seg_host), a, b, [list(r) for r in w_cpu.ranks_host], h_out, dev
    )
    rows = w.seg_host[-1]
    if layout == "x-unaligned":
        x = torch.randn(rows, h_in + 1, device=dev, dtype=dtype)[:, 1:]
    else:
        x = torch.randn(rows, h_in, device=dev, dtype=dtype)
    y = torch.randn(rows, sum(h_out), device=dev, dtype=dtype)
    workspace = torch.full((rows, w.max_rank), float("nan"), device=dev)
    y_ref = add_lora_sgmv(y.clone(), x, w, 1, backend=REF)
    y_our = add_lora_sgmv(y.clone(), x, w, 1, workspace=workspace, backend=get_backend(dev))
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(y_our, y_ref, rtol=tol, atol=tol, msg=lambda m: f"seed={seed}: {m}")
    v_ref = sgmv_shrink(x, w, 1, backend=REF)
    v_our = sgmv_shrink(x, w, 1, backend=get_backend(dev))  # public shrink: v zeroed around
    torch.testing.assert_close(v_our, v_ref, rtol=tol, atol=tol * 10)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("h_in", [4096, 136])
@pytest.mark.parametrize("layout", ["aligned", "x-unaligned"])
def test_sgmv_cuda_fixed_order_rows_do_not_depend_on_the_batch(dtype, h_in, layout):
    """The batch-invariant order (ops.invariance, sgmv_fixed_order): a row of a segment of 1,
    2, 5, 9 or 40 rows among others gives the bits it gives alone in a one-row segment, where
    the kernels' own order spreads K over more warps or chunks for a small batch. x out of
    16-byte units takes the split-K shrink, in one chunk."""
    from punica_x.ops.sgmv import sgmv_fixed_order

    gen, _ = fresh_generator()
    dev = torch.device("cuda")
    h_out, rank, layers = [256, 64, 64], 16, 2
    lens = [9, 1, 2, 5, 40]  # rows per segment; the second is the base model's
    ranks = [[rank] * 3 for _ in lens]
    ranks[1] = [0, 0, 0]
    a = [(0.1 * torch.randn(layers, 3 * rank, h_in, generator=gen)).to(dev, dtype) for _ in lens]
    b = [(0.1 * torch.randn(layers, rank * sum(h_out), generator=gen)).to(dev, dtype) for _ in lens]
    a[1] = b[1] = None
    seg = [0]
    for n in lens:
        seg.append(seg[-1] + n)
    rows = seg[-1]
    width = h_in + (layout == "x-unaligned")
    x = torch.randn(rows, width, generator=gen).to(dev, dtype)[:, width - h_in :]
    y0 = torch.randn(rows, sum(h_out), generator=gen).to(dev, dtype)
    backend = sgmv_fixed_order(dev)
    assert backend.name == "cuda" and backend.fixed_order

    def run(seg_, a_, b_, ranks_, rows_x, rows_y):
        w = SgmvWeights.build(seg_, a_, b_, ranks_, h_out, dev)
        return add_lora_sgmv(rows_y.clone(), rows_x, w, 1, backend=backend)

    batch = run(seg, a, b, ranks, x, y0)
    for s, n in enumerate(lens):
        for t in range(seg[s], seg[s] + n):
            alone = run([0, 1], [a[s]], [b[s]], [ranks[s]], x[t : t + 1], y0[t : t + 1])
            assert torch.equal(alone[0], batch[t]), (s, n, t)
