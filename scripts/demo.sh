#!/usr/bin/env bash
# Install grpokit and run the built-in demo end to end (arguments go to `grpokit demo`).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python.sh
bash scripts/install.sh
"$PYTHON" -m grpokit demo "$@"
