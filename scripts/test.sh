#!/usr/bin/env bash
# Install grpokit with its test dependencies, lint, and run the whole test suite (arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
bash scripts/install.sh dev
# A real browser for the report test (tests/cli/test_report.py skips, saying so, where there is none).
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null && command -v apt-get >/dev/null; then
  SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo "sudo -n")
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "note: chromium could not be installed; the browser test will be skipped"
fi
"$PYTHON" -m ruff check --no-cache src tests benchmarks examples
"$PYTHON" -m pytest "$@"
