#!/usr/bin/env bash
# System packages the test suite needs beyond .venv: Debian's Chromium and ChromeDriver for
# the web page test (a test tool's own browser download fails on an offline machine), and
# SIMDe's headers (libsimde-dev) for the kernels' AVX-512 builds emulated on a CPU without
# AVX-512 (punica_x/ops/isa.py; their tests are skipped where the headers are missing).
set -euo pipefail
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
