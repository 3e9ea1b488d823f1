"""The GGUF header read in one pass (models.gguf_header) against gguf.GGUFReader on the
default model and on written files, and its refusals of malformed tensor infos."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from helpers import write_gguf

from punica_x.models import gguf_header, gguf_native
from punica_x.models.loader import default_model_path


def _same_as_the_reader(path) -> gguf_header.GgufHeader:
    header = gguf_header.read_header(path, ("general.architecture", "general.name"))
    reader = GGUFReader(str(path))
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors, strict=True):
        assert ours.dims == tuple(int(d) for d in theirs.shape)
        assert ours.ggml_type == int(theirs.tensor_type) and ours.offset == theirs.data_offset
        assert gguf_header.nbytes(ours) == int(theirs.n_bytes)
        data, want = gguf_header.tensor_data(mapped, ours), np.asarray(theirs.data)
        assert data.dtype == want.dtype and data.shape == want.shape
        assert np.array_equal(data.view(np.uint8), want.view(np.uint8)), ours.name
    for key, value in header.values.items():
        assert value == reader.fields[key].contents(), key
    return header


def test_the_default_model_reads_as_the_gguf_reader_reads_it():
    path = default_model_path()
    header = _same_as_the_reader(path)
    assert header.values["general.architecture"] == gguf_native.architecture(path) == "llama"
    assert len(header.tensors) == 272 and header.data_start % 32 == 0


def test_written_files_of_every_kind_read_as_the_gguf_reader_reads_them(tmp_path):
    """float32, float16 and int32 arrays, Q4_K / Q8_0 block bytes, and a tensor whose
    offset the writer padded to the alignment."""
    rng = np.random.default_rng(0)
    tensors = {
        "a": (rng.standard_normal((3, 5)).astype(np.float32), None),
        "b": (rng.standard_normal(7).astype(np.float16), None),
        "c": (np.arange(6, dtype=np.int32).reshape(2, 3), None),
        "q4k": (rng.integers(0, 256, (4, 144), dtype=np.uint8), GGMLQuantizationType.Q4_K),
        "q8": (rng.integers(0, 256, (2, 68), dtype=np.uint8), GGMLQuantizationType.Q8_0),
    }
    header = _same_as_the_reader(write_gguf(tmp_path / "m.gguf", tensors))
    assert [t.dims for t in header.tensors] == [(5, 3), (7,), (3, 2), (256, 4), (64, 2)]


def _file(infos: bytes, n_tensors: int, pairs: bytes = b"", n_pairs: int = 0) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_pairs) + pairs + infos
    return head + bytes(-len(head) % 32) + bytes(256)  # the data section: 256 zero bytes


def _info(name: str, dims: tuple[int, ...], kind: int = 0, offset: int = 0) -> bytes:
    packed = struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", len(dims))
    return packed + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", kind, offset)


def _alignment(kind: int, value: bytes) -> bytes:
    return struct.pack("<Q", 17) + b"general.alignment" + struct.pack("<I", kind) + value


def _aligned(kind: int, value: bytes) -> bytes:
    """A file of one tensor whose general.alignment is `value` of GGUF type `kind`."""
    return _file(_info("w", (4,)), 1, _alignment(kind, value), 1)


def test_malformed_tensor_infos_are_refused_naming_the_file(tmp_path):
    path = tmp_path / "bad.gguf"
    fine = _file(_info("w", (16, 4)), 1)
    path.write_bytes(fine)
    (t,) = gguf_header.read_header(path).tensors
    assert (t.name, t.dims, t.ggml_type) == ("w", (16, 4), 0)
    cases = {
        "no dims": (_file(_info("w", ()), 1), "has 0 dims"),
        "5 dims": (_file(_info("w", (1, 1, 1, 1, 1)), 1), "has 5 dims"),
        "an unknown type": (_file(_info("w", (4,), kind=99), 1), "unknown ggml type 99"),
        "past the end": (_file(_info("w", (16, 16)), 1), "past the end of the file"),
        "a huge offset": (_file(_info("w", (4,), offset=1 << 62), 1), "past the end"),
        "a huge dim": (_file(_info("w", (1 << 62, 1 << 62)), 1), "past the end"),
        "twice": (_file(_info("w", (4,)) + _info("w", (4,)), 2), "'w' appears twice"),
        "part of a block": (_file(_info("q", (40, 1), kind=8), 1), "not whole blocks"),
        "cut in the infos": (fine[:40], "the header ends"),
        "more infos than there are": (_file(_info("w", (4,)), 3), "malformed"),
        "alignment 0": (_aligned(4, struct.pack("<I", 0)), "alignment 0 is not"),
        "alignment 3": (_aligned(4, struct.pack("<I", 3)), "alignment 3 is not"),
        "alignment a bool": (_aligned(7, b"\x01"), "alignment True is not"),
        "alignment text": (_aligned(8, struct.pack("<Q", 1) + b"x"), "alignment 'x' is not"),
    }  # fmt: skip
    for what, (data, says) in cases.items():
        path.write_bytes(data)
        with pytest.raises(ValueError, match="^bad.gguf: a malformed GGUF header") as caught:
            gguf_header.read_header(path)
            pytest.fail(what)
        assert says in str(caught.value), (what, str(caught.value))


def test_a_kept_value_is_read_and_others_are_skipped(tmp_path):
    path = tmp_path / "m.gguf"
    pairs = _alignment(4, struct.pack("<I", 64)) + struct.pack("<Q", 1) + b"k"
    pairs += struct.pack("<I", 6) + struct.pack("<f", 2.5)
    path.write_bytes(_file(_info("w", (4,)), 1, pairs, 2))
    header = gguf_header.read_header(path, ("k",))
    assert header.values == {"general.alignment": 64, "k": 2.5}
    assert header.data_start % 64 == 0 and header.tensors[0].offset == header.data_start
    assert gguf_header.read_header(path).values == {"general.alignment": 64}
