#!/usr/bin/env bash
# System packages the test suite needs beyond .venv: Debian's Chromium and ChromeDriver for
# the web page test (a test tool's own browser download fails on an offline machine).
set -euo pipefail
if { command -v chromium && command -v chromedriver; } >/dev/null 2>&1; then
  exit 0
fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "test-deps: installing chromium and chromium-driver (apt)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
else
  echo "test-deps: chromium + chromium-driver are missing and cannot be installed here;" \
    "the web page test will fail" >&2
fi
