#!/usr/bin/env bash
# OpenEnv's tests (pytest marker `openenv`: environment: openenv:TARGET) in an environment of their own, built here
# once (.venv-openenv, about 1.5 GB): OpenEnv pins mcp otherwise than verifiers does, so the two do not share one.
# openenv is the release the tests were run with; arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/integration_venv.sh
VENV=${OPENENV_VENV:-.venv-openenv}
integration_venv "$VENV" "openenv.core, grpokit" -e '.[openenv]' openenv==0.10.0
"$VENV/bin/python" -m pytest -m openenv tests/tasks/test_openenv.py "$@"
