#!/usr/bin/env bash
# The verifiers 0.4 adapter's tests (pytest marker `verifiers_v1`: grpokit.agents.verifiers_v1, v1 environments run
# as agents against grpokit's policy server) in an environment of their own, built here once (.venv-verifiers-v1,
# Python >= 3.11 as verifiers 0.4 needs): 0.4 and 0.3 cannot share one, and 0.4 pins mcp otherwise than openenv. The
# tests' two offline v1 environments (tests/agents/vf_v1_env) are installed into it, as verifiers finds environments:
# by module name. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/integration_venv.sh
VENV=${VERIFIERS_V1_VENV:-.venv-verifiers-v1}
integration_venv "$VENV" "verifiers.v1, fastapi, grpokit, vf_v1_arith" -e '.[dev,serve,verifiers_v1]' \
  -e tests/agents/vf_v1_env
"$VENV/bin/python" -m pytest -m verifiers_v1 tests/agents/test_verifiers_v1.py tests/agents/test_verifiers_v1_training.py "$@"
