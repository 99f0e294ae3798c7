#!/usr/bin/env bash
# Install grpokit with its test dependencies, lint, and run the whole test suite (arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
bash scripts/install.sh dev
"$PYTHON" -m ruff check src tests benchmarks
"$PYTHON" -m pytest "$@"
