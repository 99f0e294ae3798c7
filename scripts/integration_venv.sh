# Sourced by scripts/test_verifiers.sh and scripts/test_openenv.sh: `integration_venv VENV IMPORTS PIP_ARGS...` builds
# VENV once (PyPI's torch 2.13.0, the CPU build where pip finds one, then `pip install -q PIP_ARGS` and the test
# tools), unless its Python already imports IMPORTS (e.g. "verifiers, grpokit").
integration_venv() {
  local venv=$1 imports=$2
  shift 2
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import $imports" 2>/dev/null; then
    "${PYTHON:-python3}" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q torch==2.13.0
    "$venv/bin/python" -m pip install -q "$@" pytest pytest-timeout hypothesis
  fi
}
