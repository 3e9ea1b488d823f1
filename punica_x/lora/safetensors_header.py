"""A safetensors file's header, read without torch or the safetensors package: each tensor's
dtype, shape and where its bytes lie, and whether its float values hold a NaN or an Inf (on
their bits, with numpy). The frontend checks uploads with it (punica_x/lora/peft_checks.py);
a runner still loads the file with safetensors itself."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

# safetensors' dtype names -> (torch's name, the bytes of one value)
SAFETENSORS_DTYPES = {
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F32": ("float32", 4),
    "F64": ("float64", 8),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on the JSON header
# a float is NaN or Inf when its exponent bits are all set: (the values' unsigned view, them)
_EXPONENT = {
    "float16": ("<u2", 0x7C00),
    "bfloat16": ("<u2", 0x7F80),
    "float32": ("<u4", 0x7F800000),
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file as its header declares it: dtype (torch's name),
    shape, and where its bytes lie in the file [start, stop)."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int

    def finite(self, data: bytes) -> bool:
        """No NaN or Inf among its values in `data` (the file's bytes): a float is one when
        its exponent bits are all set."""
        import numpy as np

        kind, exponent = _EXPONENT[self.dtype]
        values = np.frombuffer(data, dtype=kind, count=math.prod(self.shape), offset=self.start)
        return not bool(((values & exponent) == exponent).any())


def read_header(path: Path) -> dict[str, TensorEntry]:
    """{tensor name: TensorEntry} of a safetensors file, from its header alone (its
    __metadata__ skipped); ValueError naming what is wrong when it is not one (OSError when
    it cannot be read)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than its header length")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"header length {n} past the file's {size} bytes")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    return {name: _entry(name, entry, 8 + n, size) for name, entry in entries.items()}


def _entry(name: str, entry, data_start: int, size: int) -> TensorEntry:
    """One header entry, its bytes inside the file's data section."""
    bad = ValueError(f"a malformed header entry for {name!r}")
    if not isinstance(entry, dict) or entry.get("dtype") not in SAFETENSORS_DTYPES:
        raise bad
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    ints = (isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in shape + offsets
    )
    if not ints:
        raise bad
    dtype, itemsize = SAFETENSORS_DTYPES[entry["dtype"]]
    start, stop = data_start + offsets[0], data_start + offsets[1]
    if stop - start != math.prod(shape) * itemsize or stop > size:
        raise bad
    return TensorEntry(dtype, tuple(shape), start, stop)
