"""SGMV on AMX tiles (csrc/sgmv/amx.h) against the PyTorch reference and the vector kernels.

The emulated mode runs the tiles code with scalar tiles on any avx512_bf16 build (packing,
transposes, remainders of rows, ranks and columns, several slices); the hardware mode needs
AMX-BF16 (Intel Xeon 4th generation and later) and is skipped elsewhere. Every case checks
that its segments really ran on tiles (the binding's item counter) or really did not.
"""

import contextlib
import os
import random

import pytest
import torch
from test_sgmv import REF, cast, make_weights

from punica_x.ops import amx_tiles
from punica_x.ops import isa as isa_mod
from punica_x.ops.sgmv import SgmvWeights, add_lora_sgmv, cpu_backend

pytestmark = pytest.mark.skipif(
    "avx512_bf16" not in isa_mod.runnable_levels(), reason="AMX tiles live in the avx512_bf16 build"
)

OFF, HARDWARE, EMULATED = 0, 1, 2


def backend():
    return cpu_backend("avx512_bf16")


def has_tiles() -> bool:
    """AMX-BF16 tiles usable here (asked only where the avx512_bf16 build can run: at
    collection, before the module's skip applies, on an AVX2-only CPU it cannot load)."""
    return "avx512_bf16" in isa_mod.runnable_levels() and backend().module.amx_available()


@contextlib.contextmanager
def amx(mode: int, min_rows: int):
    mod = backend().module
    before = mod.sgmv_amx(mode, min_rows)
    try:
        yield mod
    finally:
        mod.sgmv_amx(*before)


def bf16_weights(gen, seg_lens, slice_ranks, h_in, h_out, layers=3) -> SgmvWeights:
    return cast(make_weights(gen, seg_lens, slice_ranks, h_in, h_out, layers), torch.bfloat16)


def run(w: SgmvWeights, x, y0, layer, be):
    y = y0.clone()
    v = torch.zeros(x.shape[0], max(w.max_rank, 1))
    add_lora_sgmv(y, x, w, layer, v, be)
    return y.float()


# (segment rows, per segment its slices' ranks or None for base rows, h_in, h_out per slice)
CASES = [
    ([32], [[16, 16, 16]], 576, [576, 192, 192]),  # Identical's q|k|v, SmolLM2's widths
    ([17], [[64, 40]], 1536, [40, 100]),  # a rank past one item (64), column remainders
    ([20, 3, 9], [[8], None, [24]], 64, [200]),  # base rows between, a short segment
    ([8, 16, 1], [[16, 0], [32, 16], [16, 16]], 96, [48, 33]),  # untargeted slice, one row
    ([40], [[5]], 32, [16]),  # three row blocks (16, 16, 8), rank 5
]


def check_mode(mode: int, case, seed: int):
    seg_lens, ranks, h_in, h_out = case
    gen = torch.Generator().manual_seed(seed)
    w = bf16_weights(gen, seg_lens, ranks, h_in, h_out)
    n = sum(seg_lens)
    x = torch.randn(n, h_in, generator=gen).bfloat16()
    y0 = torch.randn(n, sum(h_out), generator=gen).bfloat16()
    layer = random.Random(seed).randrange(3)
    ref = run(w, x, y0, layer, REF)
    with amx(OFF, 8):
        vector = run(w, x, y0, layer, backend())
    with amx(mode, 8) as mod:
        before = mod.amx_items()
        tiles = run(w, x, y0, layer, backend())
        ran = mod.amx_items() - before
    tiled = [s for s, (n_rows, r) in enumerate(zip(seg_lens, ranks)) if r and n_rows >= 8]
    assert (ran > 0) == bool(tiled), (ran, tiled)
    # both paths sum in float32 and round y once: within an ulp or two of y's bf16
    tol = 2e-2 * (1 + ref.abs())
    assert ((tiles - ref).abs() <= tol).all(), (tiles - ref).abs().max()
    assert ((tiles - vector).abs() <= tol).all(), (tiles - vector).abs().max()
    short = [r for s, (n_rows, r) in enumerate(zip(seg_lens, ranks)) if n_rows < 8]
    if short:  # rows of segments under min_rows take the vector kernels: bit-identical there
        rows = torch.cat(
            [
                torch.arange(w.seg_host[s], w.seg_host[s + 1])
                for s in range(len(seg_lens))
                if seg_lens[s] < 8
            ]
        )
        assert torch.equal(tiles[rows], vector[rows])


IDS = ["identical-qkv", "rank-past-one-item", "base-rows", "untargeted-slice", "three-row-blocks"]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_emulated_tiles_match_reference(case):
    check_mode(EMULATED, case, int.from_bytes(os.urandom(4), "little"))


@pytest.mark.skipif(not has_tiles(), reason="needs AMX-BF16 tiles")
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_hardware_tiles_match_reference(case):
    check_mode(HARDWARE, case, int.from_bytes(os.urandom(4), "little"))


def test_float32_and_short_segments_never_take_tiles():
    gen = torch.Generator().manual_seed(1)
    w32 = make_weights(gen, [32], [[16]], 64, [64], 2)
    x = torch.randn(32, 64, generator=gen)
    with amx(EMULATED, 1) as mod:
        before = mod.amx_items()
        run(w32, x, torch.zeros(32, 64), 1, backend())
        assert mod.amx_items() == before  # float32 stays on the vector kernels
    w = bf16_weights(gen, [7, 1], [[16], [16]], 64, [64])
    with amx(EMULATED, 8) as mod:
        before = mod.amx_items()
        run(w, x[:8].bfloat16(), torch.zeros(8, 64).bfloat16(), 1, backend())
        assert mod.amx_items() == before  # no segment reaches 8 rows
    with amx(EMULATED, 2) as mod:
        before = mod.amx_items()
        run(w, x[:8].bfloat16(), torch.zeros(8, 64).bfloat16(), 1, backend())
        assert mod.amx_items() - before == 2  # the 7-row segment: one shrink and one expand item


def test_h_in_off_the_tile_width_shrinks_on_vectors_and_expands_on_tiles():
    gen = torch.Generator().manual_seed(2)
    w = bf16_weights(gen, [16], [[16]], 48, [32])  # 48 is not a multiple of 32
    x = torch.randn(16, 48, generator=gen).bfloat16()
    y0 = torch.randn(16, 32, generator=gen).bfloat16()
    ref = run(w, x, y0, 0, REF)
    with amx(EMULATED, 8) as mod:
        before = mod.amx_items()
        got = run(w, x, y0, 0, backend())
        assert mod.amx_items() - before == 1  # the expand only
    assert ((got - ref).abs() <= 2e-2 * (1 + ref.abs())).all()


def test_a_thread_configures_its_tiles_once_per_launch_phase():
    # Identical's q|k|v: one shrink item and 15 expand items (64 columns each), two row blocks
    # of 16 each; every item used to load its configuration per row block (32 in all)
    gen = torch.Generator().manual_seed(3)
    w = bf16_weights(gen, [32], [[16, 16, 16]], 576, [576, 192, 192])
    x = torch.randn(32, 576, generator=gen).bfloat16()
    y0 = torch.randn(32, 960, generator=gen).bfloat16()
    threads = torch.get_num_threads()
    with amx(EMULATED, 8) as mod:
        items, configs = mod.amx_items(), mod.amx_configs()
        got = run(w, x, y0, 1, backend())
        assert mod.amx_items() - items == 16
        assert 2 <= mod.amx_configs() - configs <= 2 * threads  # one per thread and phase
        again = run(w, x, y0, 1, backend())  # a new launch configures again, same result
    assert torch.equal(got, again)
    assert ((got - run(w, x, y0, 1, REF)).abs() <= 2e-2 * (1 + got.abs())).all()


@pytest.mark.parametrize(
    "mode,min_rows,match",
    [
        (3, 0, "mode must be"),
        (-2, 0, "mode must be"),
        (0, -1, "min_rows"),
        (2**40, 0, "incompatible function arguments"),
    ],
)
def test_bad_settings_are_refused_and_change_nothing(mode, min_rows, match):
    mod = backend().module
    before = mod.sgmv_amx()
    with pytest.raises((RuntimeError, TypeError), match=match):
        mod.sgmv_amx(mode, min_rows)
    assert mod.sgmv_amx() == before


def test_hardware_mode_is_refused_without_amx():
    mod = backend().module
    if mod.amx_available():
        pytest.skip("this CPU has AMX tiles")
    before = mod.sgmv_amx()
    with pytest.raises(RuntimeError, match="no AMX-BF16 tiles"):
        mod.sgmv_amx(HARDWARE, 0)
    assert mod.sgmv_amx() == before == (OFF, before[1])


@pytest.mark.parametrize(
    "value", ["2", "yes", "on", "-1", "1e9", "0x1", "", "1 1", "AUTO!", "true"]
)
def test_env_setting_takes_auto_0_or_1_only(value, monkeypatch):
    mod = backend().module
    monkeypatch.setenv("PUNICA_X_SGMV_AMX", value)
    before = mod.sgmv_amx()
    with pytest.raises(ValueError, match="PUNICA_X_SGMV_AMX must be auto, 0 or 1"):
        amx_tiles.apply_setting(mod)
    assert mod.sgmv_amx() == before


def test_env_setting_turns_tiles_on_where_there_are_tiles_and_is_refused_elsewhere(monkeypatch):
    mod = backend().module
    has_tiles = mod.amx_available()
    with amx(EMULATED, 8):
        monkeypatch.setenv("PUNICA_X_SGMV_AMX", "0")
        amx_tiles.apply_setting(mod)
        assert mod.sgmv_amx()[0] == OFF  # 0: the vector kernels, whatever was set before
        for value in ("auto", " auto "):  # the default: tiles where there are tiles
            monkeypatch.setenv("PUNICA_X_SGMV_AMX", value)
            amx_tiles.apply_setting(mod)
            assert mod.sgmv_amx()[0] == (HARDWARE if has_tiles else OFF)
        monkeypatch.setenv("PUNICA_X_SGMV_AMX", " 1 ")
        if has_tiles:
            amx_tiles.apply_setting(mod)
            assert mod.sgmv_amx()[0] == HARDWARE
        else:
            mod.sgmv_amx(OFF, 0)
            with pytest.raises(RuntimeError, match="PUNICA_X_SGMV_AMX=1: .*no AMX-BF16 tiles"):
                amx_tiles.apply_setting(mod)
            assert mod.sgmv_amx()[0] == OFF


def test_auto_stays_on_vectors_with_a_warning_where_linux_refuses_the_tiles(monkeypatch, caplog):
    class RefusingModule:  # a CPU with tiles whose OS refuses this process their state
        mode = OFF

        def amx_available(self):
            return True

        def sgmv_amx(self, mode=-1, min_rows=0):
            if mode == HARDWARE:
                raise RuntimeError(
                    "amx mode 1 (hardware): Linux refused this process the tile state"
                )
            before, self.mode = self.mode, mode if mode >= 0 else self.mode
            return before, 8

    mod = RefusingModule()
    monkeypatch.setenv("PUNICA_X_SGMV_AMX", "auto")
    with caplog.at_level("WARNING", logger="punica_x.ops"):
        amx_tiles.apply_setting(mod)
    assert mod.mode == OFF and "vector kernels: amx mode 1" in caplog.text
    monkeypatch.setenv("PUNICA_X_SGMV_AMX", "1")
    with pytest.raises(RuntimeError, match="PUNICA_X_SGMV_AMX=1: .*refused"):
        amx_tiles.apply_setting(mod)


def test_the_setting_applies_once_per_module_so_later_loads_keep_a_mode_set_since():
    mod = backend().module
    with amx(EMULATED, 8):
        assert backend().module is mod and mod.sgmv_amx()[0] == EMULATED


def test_builds_without_the_path_refuse_to_turn_it_on():
    for isa in ("avx512", "avx2"):
        if isa not in isa_mod.runnable_levels():
            continue
        mod = cpu_backend(isa).module
        assert mod.sgmv_amx() == (OFF, 0) and not mod.amx_available()
        with pytest.raises(RuntimeError, match="has no AMX tiles path"):
            mod.sgmv_amx(EMULATED, 0)
