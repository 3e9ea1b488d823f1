#!/usr/bin/env bash
# Before the first call to a lent GPU machine (it has no network): put into .whl/ the wheels
# of the packages its image lacks (the versions of this checkout's .venv, for CPython 3.12 on
# x86-64 Linux), SmolLM2's tokenizer files into .gpu/tokenizer and a stand-in of the default
# model into .gpu/standin.gguf (scripts/gguf_standin.py); both folders are excluded from git
# here and must be named in the device call's `carry`. Then, there: bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
# the lent image has torch, transformers, peft, accelerate, safetensors, prometheus-client,
# httpx, uvloop; not these (ray and flashinfer are too large for the 64 MiB a call carries)
NEEDED="starlette uvicorn httptools websockets python-multipart llguidance gguf pydantic
pydantic_core annotated-types typing-inspection jsonschema jsonschema-specifications
referencing rpds-py pyzmq"
mkdir -p .whl .gpu/tokenizer .git/info
for p in /.whl/ /.gpu/; do grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
for name in $NEEDED; do
  version=$("$PY" -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}')
  [ -n "$version" ] || { echo "gpu_check_prepare: $name is not installed in $PY" >&2; exit 1; }
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "$name==$version"
done
"$PY" - <<'PYEOF'
import shutil
from pathlib import Path

from punica_x.models.loader import resolve_model_dir

src = Path(resolve_model_dir(None))
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    if (src / name).exists():
        shutil.copy(src / name, Path(".gpu/tokenizer") / name)
PYEOF
# the default model's first 2 layers (~36 MB; the whole 98 MB file is over what a call carries)
"$PY" scripts/gguf_standin.py .gpu/standin.gguf --layers 2
du -sh .whl .gpu
