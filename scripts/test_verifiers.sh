#!/usr/bin/env bash
# The verifiers adapter's tests (pytest marker `verifiers`: environment: verifiers:NAME) in an environment of their
# own, built here once (.venv-verifiers): verifiers pins mcp, openai and others differently from openenv, so the two
# need not share one. torch is PyPI's 2.13.0 (the CPU build where pip finds one); arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VERIFIERS_VENV:-.venv-verifiers}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import verifiers, grpokit" 2>/dev/null; then
  "${PYTHON:-python3}" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q torch==2.13.0
  "$VENV/bin/python" -m pip install -q -e '.[verifiers]' pytest pytest-timeout hypothesis
fi
"$VENV/bin/python" -m pytest -m verifiers tests/tasks/test_verifiers.py "$@"
