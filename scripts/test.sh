#!/usr/bin/env bash
# Install grpokit with its test dependencies, lint, and run the whole test suite (arguments go to pytest). As root,
# then the same again where users run it: as a normal user in a fresh venv (scripts/test_as_user.sh;
# GRPOKIT_TEST_AS_USER=0 leaves it out).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python.sh
bash scripts/install.sh dev
# A real browser for the report test (tests/cli/test_report.py skips, saying so, where there is none).
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null && command -v apt-get >/dev/null; then
  SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo "sudo -n")
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "note: chromium could not be installed; the browser test will be skipped"
fi
"$PYTHON" -m ruff check --no-cache src tests benchmarks examples
"$PYTHON" -m pytest "$@"
if [ "$(id -u)" = 0 ] && [ "${GRPOKIT_TEST_AS_USER:-1}" != 0 ]; then
  bash scripts/test_as_user.sh "$@"
fi
