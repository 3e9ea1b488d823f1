"""A stand-in for the default model on a lent GPU machine, whose 64 MiB carry cannot hold the
98 MB file: the default GGUF file's first `--layers` blocks (its own Q4_1 / Q8_0 / F32
tensors, byte for byte: the embedding / tied head, the norms and those layers), with its
metadata (the tokenizer and chat template included) and block_count set to `--layers`.
~35 MB with 2 layers. It answers nothing sensible; the GPU test compares what CUDA computes
of it with what the CPU computes of the same file (tests/punica_x/test_engine_cuda.py).

    python scripts/gguf_standin.py OUT.gguf [--layers 2] [--source FILE]
Follows gguf's own scripts/gguf_new_metadata.py (copy_with_new_metadata)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import gguf


def kept(name: str, layers: int) -> bool:
    """Whether the tensor `name` belongs to the first `layers` blocks or to no block."""
    m = re.match(r"blk\.(\d+)\.", name)
    return m is None or int(m.group(1)) < layers


def write_standin(source: Path, out: Path, layers: int) -> int:
    """Writes the stand-in; returns its size in bytes."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    if not 0 < layers <= reader.fields[count_key].contents():
        raise SystemExit(f"--layers must be 1..{reader.fields[count_key].contents()}")
    writer = gguf.GGUFWriter(out, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    tensors = [t for t in reader.tensors if kept(t.name, layers)]
    for t in tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return out.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--source", type=Path, default=None, help="default: the default model")
    args = ap.parse_args()
    if args.source is None:
        from punica_x.models.loader import default_model_path

        args.source = Path(default_model_path())
    size = write_standin(args.source, args.out, args.layers)
    print(f"{args.out}: {args.layers} layers of {args.source.name}, {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
