#!/usr/bin/env bash
# OpenEnv's tests (pytest marker `openenv`: environment: openenv:TARGET) in an environment of their own, built here
# once (.venv-openenv, about 1.5 GB): OpenEnv pins mcp otherwise than verifiers does, so the two do not share one.
# torch is PyPI's 2.13.0 (the CPU build where the machine's pip finds it), openenv the release the tests were run with;
# arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${OPENENV_VENV:-.venv-openenv}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import openenv.core, grpokit" 2>/dev/null; then
  "${PYTHON:-python3}" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q torch==2.13.0
  "$VENV/bin/python" -m pip install -q -e '.[openenv]' openenv==0.10.0 pytest pytest-timeout hypothesis
fi
"$VENV/bin/python" -m pytest -m openenv tests/tasks/test_openenv.py "$@"
