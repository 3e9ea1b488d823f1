"""A GGUF file's header read in one pass: its key-value pairs skipped except the few the
loader asks for, then the tensor infos, and each tensor's bytes as a view of the memory-mapped
file.

gguf.GGUFReader decodes every value of every pair into numpy views first, the vocabulary's
strings among them: 4.6 s of each start with the default model (49,152 tokens and 48,900
merges, on an AVX2 EPYC), for tensors it could have located in milliseconds. This reads what
the weights need: the header's version, counts and pairs (scalars kept, strings and arrays
skipped by their lengths), the tensor infos (name, dims, ggml type, offset) and the alignment
of the data after them. The views are what GGUFReader's ReaderTensor.data holds (same dtype
and shape), so the package's dequantizers take them unchanged.

Layout (GGUF versions 2 and 3, little-endian): "GGUF", version u32, tensor count u64, pair
count u64; per pair a string key, a u32 value type and the value; per tensor a string name,
u32 n_dims, n_dims x u64 dims (ggml order: dims[0] is the row length), u32 type, u64 offset
relative to the data section, which starts at the next multiple of general.alignment (32 by
default) after the infos. A string is a u64 length and its bytes.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

import numpy as np

# scalar value types: their struct codes (little-endian) and sizes; 8 is a string, 9 an array
_SCALAR_FORMAT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q"}
_SCALAR_FORMAT |= {11: "q", 12: "d"}
SCALAR_BYTES = {kind: struct.calcsize("<" + code) for kind, code in _SCALAR_FORMAT.items()}
STRING, ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
MAX_STRING = 1 << 20  # a key, a tensor name or a kept value longer than this is malformed
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
# the element type of a tensor stored unblocked (ggml type -> numpy dtype), as GGUFReader
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32}
_PLAIN |= {27: np.int64, 28: np.float64}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: dims in ggml order (dims[0] is the row length), its ggml type
    (gguf.GGMLQuantizationType's value) and the absolute byte offset of its data."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass(frozen=True)
class GgufHeader:
    """version; values: the scalar and string values of the pairs asked for by key (others
    are skipped); tensors in file order; data_start: where the data section begins."""

    version: int
    values: dict[str, object]
    tensors: tuple[TensorInfo, ...]
    data_start: int


@cache
def _struct(fmt: str) -> struct.Struct:
    return struct.Struct("<" + fmt)


class _Cursor:
    """Reads little-endian fields from a buffer; struct.error past its end."""

    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        packed = _struct(fmt)
        if self.pos + packed.size > len(self.buf):
            raise struct.error("the header ends inside a value")
        values = packed.unpack_from(self.buf, self.pos)
        self.pos += packed.size
        return values

    def string(self) -> str:
        (n,) = self.take("Q")
        if n > MAX_STRING:
            raise ValueError(f"a GGUF header string of {n} bytes")
        self.skip(n)
        return bytes(self.buf[self.pos - n : self.pos]).decode()

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise struct.error("the header ends inside a value")
        self.pos += n


def read_header(path: Path, keys: tuple[str, ...] = ("general.alignment",)) -> GgufHeader:
    """The header of `path`, keeping the values of `keys` (scalars and strings). ValueError
    naming the file for one that is not GGUF version 2 or 3, is cut short, or whose tensor
    infos are malformed (a type gguf does not know, dims or offsets outside the file)."""
    path = Path(path)
    try:
        stat = path.stat()
        return _read(str(path.resolve()), stat.st_size, stat.st_mtime_ns, frozenset(keys))
    except (ValueError, struct.error) as e:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"{path.name}: a malformed GGUF header ({e})") from None


def clear_cache() -> None:
    """Forget the headers read so far (a benchmark times a read, not a cached header)."""
    _read.cache_clear()


@lru_cache(maxsize=8)  # a load reads it up to three times (architecture, then the tensors)
def _read(path: str, _size: int, _mtime_ns: int, keys: frozenset[str]) -> GgufHeader:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return _parse(memoryview(mm), set(keys) | {"general.alignment"})


def _parse(buf: memoryview, keep: set[str]) -> GgufHeader:
    try:
        cur = _Cursor(buf)
        magic = bytes(buf[:4])
        cur.skip(4)
        version, n_tensors, n_pairs = cur.take("IQQ")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError("not a GGUF version 2 or 3 header")
        values: dict[str, object] = {}
        for _ in range(n_pairs):
            key = cur.string()
            (kind,) = cur.take("I")
            if key in keep and (kind in _SCALAR_FORMAT or kind == STRING):
                values[key] = cur.string() if kind == STRING else cur.take(_SCALAR_FORMAT[kind])[0]
            else:
                _skip_value(cur, kind)
        infos = [_tensor_info(cur) for _ in range(n_tensors)]
        align = _alignment(values.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-cur.pos // align) * align
        tensors = tuple(TensorInfo(n, d, t, start + o) for n, d, t, o in infos)
        _check_tensors(tensors, len(buf))
        return GgufHeader(version, values, tensors, start)
    finally:
        buf.release()


def _skip_value(cur: _Cursor, kind: int, depth: int = 0) -> None:
    if depth > 4:
        raise ValueError("arrays nested more than 4 deep")
    if kind in SCALAR_BYTES:
        cur.skip(SCALAR_BYTES[kind])
    elif kind == STRING:
        cur.skip(cur.take("Q")[0])
    elif kind == ARRAY:
        item, count = cur.take("IQ")
        if item in SCALAR_BYTES:
            cur.skip(SCALAR_BYTES[item] * count)
        elif item == STRING:  # the vocabulary: lengths only
            for _ in range(count):
                cur.skip(cur.take("Q")[0])
        else:
            for _ in range(count):
                _skip_value(cur, item, depth + 1)
    else:
        raise ValueError(f"GGUF value type {kind}")


def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string()
    (n_dims,) = cur.take("I")
    if not 1 <= n_dims <= MAX_DIMS:
        raise ValueError(f"tensor {name!r} has {n_dims} dims")
    dims = cur.take(f"{n_dims}Q")
    ggml_type, offset = cur.take("IQ")
    return name, tuple(int(d) for d in dims), ggml_type, offset


def _alignment(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value & (value - 1):
        raise ValueError(f"general.alignment {value!r} is not a power of two")
    return value


def _check_tensors(tensors: tuple[TensorInfo, ...], size: int) -> None:
    names: set[str] = set()
    for t in tensors:
        if t.name in names:
            raise ValueError(f"tensor {t.name!r} appears twice")
        names.add(t.name)
        if t.offset + nbytes(t) > size:
            raise ValueError(f"tensor {t.name!r} ends past the end of the file")


def nbytes(t: TensorInfo) -> int:
    """The bytes of a tensor's data; ValueError for a ggml type gguf does not know or dims
    that do not fill whole blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
    except (ValueError, KeyError):
        raise ValueError(f"tensor {t.name!r} has an unknown ggml type {t.ggml_type}") from None
    if t.dims[0] % block:
        raise ValueError(f"tensor {t.name!r}: rows of {t.dims[0]} are not whole blocks")
    return math.prod(t.dims) // block * size  # Python ints: no overflow


def tensor_data(mapped: np.ndarray, t: TensorInfo) -> np.ndarray:
    """The tensor's bytes in `mapped` (the file as np.memmap uint8) as GGUFReader's
    ReaderTensor.data: plain types as their dtype in shape reversed(dims); block types as
    uint8, shape reversed(dims) with the last axis in bytes (dims[0] / block x block bytes)."""
    raw = mapped[t.offset : t.offset + nbytes(t)]
    shape = tuple(reversed(t.dims))
    if t.ggml_type in _PLAIN:
        return raw.view(_PLAIN[t.ggml_type]).reshape(shape)
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
    return raw.reshape(*shape[:-1], shape[-1] // block * size)
