#!/usr/bin/env bash
# Install grpokit and run the built-in demo end to end (arguments go to `grpokit demo`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
"${PYTHON:-python3}" -m grpokit demo "$@"
