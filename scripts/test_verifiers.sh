#!/usr/bin/env bash
# The verifiers adapter's tests (pytest marker `verifiers`: environment: verifiers:NAME) in an environment of their
# own, built here once (.venv-verifiers): verifiers pins mcp, openai and others differently from openenv, so the two
# need not share one. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/integration_venv.sh
VENV=${VERIFIERS_VENV:-.venv-verifiers}
integration_venv "$VENV" "verifiers, grpokit" -e '.[verifiers]'
"$VENV/bin/python" -m pytest -m verifiers tests/tasks/test_verifiers.py "$@"
