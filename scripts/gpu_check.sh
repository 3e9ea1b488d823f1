#!/usr/bin/env bash
# Every GPU check in one command, on a CUDA machine with no network (see scripts/gpu_check.py):
#   scripts/gpu_check.sh [--dry-run] [--budget-s 450] [--results DIR] [...]
# Installs the wheels carried in .whl/ (if any; not on a --dry-run) into a folder of their own,
# then runs the checks
# with the tokenizer carried in .gpu/tokenizer and the default model's stand-in in
# .gpu/standin.gguf (if present; scripts/gpu_check_prepare.sh makes both). $PYTHON picks the interpreter
# (default: python3, the one holding torch on the lent machines).
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
dry=0
for a in "$@"; do [ "$a" = "--dry-run" ] && dry=1; done
if [ "$dry" = 1 ]; then
  echo "[gpu_check] dry run: the wheels in .whl/ (if any, built for the lent machine) left alone"
elif compgen -G ".whl/*.whl" > /dev/null; then
  site="${PUNICA_X_WHEEL_SITE:-/tmp/punica-x-site}"
  start=$(date +%s)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl || { echo "gpu_check: installing .whl/ failed" >&2; exit 3; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  echo "[gpu_check] wheels: $(ls .whl | wc -l) installed in $(( $(date +%s) - start )) s"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the default model's stand-in (scripts/gguf_standin.py) for the test that needs its file
if [ -f .gpu/standin.gguf ]; then export PUNICA_X_GPU_STANDIN="$PWD/.gpu/standin.gguf"; fi
tok=()
if [ -d .gpu/tokenizer ]; then tok=(--tokenizer "$PWD/.gpu/tokenizer"); fi
exec "$PY" scripts/gpu_check.py "${tok[@]}" "$@"
