#!/usr/bin/env bash
# Install grpokit (editable) with the extras given as $1 (e.g. "dev"), into the interpreter scripts/python.sh picks.
# PyTorch is installed first only when missing, as the 2.13.0 wheel: on a CPU-only machine that has
# it on disk (such as our CI) this is the CPU build, elsewhere pip picks the platform default.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python.sh
"$PYTHON" -c "import torch" 2>/dev/null || "$PYTHON" -m pip install torch==2.13.0
"$PYTHON" -m pip install -e ".${1:+[$1]}"
