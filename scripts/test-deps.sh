#!/usr/bin/env bash
# What the test suite needs beyond .venv's packages: Debian's Chromium and ChromeDriver for
# the web page test (a test tool's own browser download fails on an offline machine), and
# SIMDe's headers (libsimde-dev) for the kernels' AVX-512 builds emulated on a CPU without
# AVX-512 (punica_x/ops/isa.py; their tests are skipped where the headers are missing).
# And Triton, for its interpreter running the batch-invariant CUDA kernels' tests on a CPU
# (tests/triton_interpreter.py), in $VENV/triton rather than in site-packages: torch imports
# an installed Triton in every process that loads torch._dynamo (+0.7 s a start). Machines
# whose torch carries Triton (CUDA builds) need none.
set -euo pipefail
VENV="${1:-.venv}"
TRITON_VERSION="3.9.0"  # the interpreter's internals the tests mend (tests/triton_interpreter.py)
if ! "$VENV/bin/python" -c "import triton" 2>/dev/null &&
  [ "$(cat "$VENV/triton/.version" 2>/dev/null)" != "$TRITON_VERSION" ]; then
  echo "test-deps: installing triton==$TRITON_VERSION into $VENV/triton (interpreter tests)"
  rm -rf "$VENV/triton"
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q --no-deps \
    --target "$VENV/triton" "triton==$TRITON_VERSION"
  echo "$TRITON_VERSION" > "$VENV/triton/.version"
fi
missing=()
{ command -v chromium && command -v chromedriver; } >/dev/null 2>&1 || missing+=(chromium chromium-driver)
[ -f /usr/include/simde/x86/avx512.h ] || missing+=(libsimde-dev)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "test-deps: installing ${missing[*]} (apt)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
else
  echo "test-deps: ${missing[*]} missing and cannot be installed here; the web page test" \
    "fails without chromium, the emulated AVX-512 kernel tests are skipped without SIMDe" >&2
fi
