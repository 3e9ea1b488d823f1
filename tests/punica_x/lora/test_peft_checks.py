"""peft_checks.check_peft_header: the frontend's check of an upload, from its config and its
safetensors header, without torch. It learns what load_peft_adapter learns (rank, modules,
digest, stored dtypes) and refuses what it refuses but for values (test_adapter.py's
`refused` runs both on every refusal there); a malformed header is refused by name."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
import torch
from helpers import plant_value, rewrite_config
from safetensors.torch import load_file, save_file

from punica_x.config import ModelConfig
from punica_x.lora.adapter import load_peft_adapter
from punica_x.lora.peft_checks import (
    WEIGHTS_FILE,
    AdapterError,
    LoraTarget,
    check_peft_header,
    read_header,
)
from punica_x.models.loader import describe_model


@pytest.fixture(scope="module")
def target(tiny_model_dir) -> LoraTarget:
    dims = describe_model(ModelConfig(model=str(tiny_model_dir))).dims
    return LoraTarget(dims.num_layers, dims.lora_shapes())


def _summary_of_load(path, target):
    a = load_peft_adapter(path, target, 64, torch.float32)
    return a.rank, a.target_modules, a.sha256, a.stored_dtype


def test_it_learns_what_loading_learns(tiny_adapters, target, tmp_path):
    mixed = rewrite_config(tiny_adapters["r8"], tmp_path / "mixed")
    weights = load_file(mixed / WEIGHTS_FILE)
    first = sorted(weights)[0]
    weights[first] = weights[first].to(torch.bfloat16)
    save_file(weights, mixed / WEIGHTS_FILE)
    for path in [*tiny_adapters.values(), mixed]:
        s = check_peft_header(path, target, 64)
        assert (s.rank, s.target_modules, s.sha256, s.stored_dtype) == _summary_of_load(
            path, target
        )
    assert check_peft_header(mixed, target, 64).stored_dtype == "bfloat16,float32"


def _with_weights(src, dst, data: bytes):
    path = rewrite_config(src, dst)
    (path / WEIGHTS_FILE).write_bytes(data)
    return path


def _file(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize(
    "data",
    [
        b"",  # empty
        b"\x01\x02",  # shorter than the length field
        struct.pack("<Q", 10**12) + b"{}",  # a header past the file
        struct.pack("<Q", 5) + b"nope!",  # not JSON
        _file([1, 2]),  # not an object
        _file({"x": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
        _file({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 8),
        _file({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}),  # past the data
        _file({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
        _file({"x": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4),
        _file({"x": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}}, b"\0" * 4),
        _file({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, b"\0" * 4),
        _file({"x": []}),
    ],
)
def test_a_malformed_header_is_refused(data, tiny_adapters, target, tmp_path):
    path = _with_weights(tiny_adapters["r4"], tmp_path / "a", data)
    with pytest.raises(AdapterError) as info:
        check_peft_header(path, target, 64)
    assert info.value.code == "bad_weights"


def test_the_header_reader_skips_metadata(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(2, 3, dtype=torch.float16)}, path, metadata={"format": "pt"})
    (entry,) = read_header(path).values()
    assert (entry.dtype, entry.shape, entry.stop - entry.start) == ("float16", (2, 3), 12)


def test_the_check_imports_no_torch():
    code = (
        "import sys\n"
        "import punica_x.lora.peft_checks\n"
        "from punica_x.api import check_peft_header, AdapterError\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), "max", "tiny"])
def test_values_are_checked_on_their_bits(dtype, value, tiny_adapters, target, tmp_path):
    """NaN and +-Inf refused in each float dtype; the largest finite value and a subnormal
    pass, as torch.isfinite has them."""
    path = rewrite_config(tiny_adapters["r4"], tmp_path / "a")
    weights = {k: t.to(dtype) for k, t in load_file(path / WEIGHTS_FILE).items()}
    name = sorted(weights)[-1]
    plant_value(weights, name, dtype, value)
    save_file(weights, path / WEIGHTS_FILE)
    finite = bool(torch.isfinite(weights[name]).all())
    if finite:
        check_peft_header(path, target, 64)
        return
    with pytest.raises(AdapterError, match="NaN or Inf") as info:
        check_peft_header(path, target, 64)
    assert info.value.code == "non_finite"
