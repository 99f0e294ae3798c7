#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go (CI has none): the CUDA tests, DDP and FSDP2 with NCCL checkpointed and
# resumed on every GPU, a GRPO step of a real architecture and decoding against the GPU's bounds (with and without
# CUDA graphs), then (unless GPU_CHECK_QUICK=1) GRPO vs PPO memory and speed at sizes too large for a CPU and the
# whole suite on the machine's own torch/transformers versions. Run from the repository root on a GPU machine with
# torch, transformers, tokenizers, safetensors, tqdm, pyyaml, pytest, hypothesis, numpy and matplotlib
# installed (no install step: nothing is fetched).
# Results go to ${OUT:-gpu-check}/.
set -uo pipefail
out="${OUT:-gpu-check}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/algorithms/test_cuda.py 2>&1 | tee "$out/cuda_tests.log"
# DDP and FSDP2 with NCCL on every GPU listed (1 GPU: the one-process paths), a checkpoint and a resume in new processes
# that must end bit-identical to a straight run; a pass/fail table with tokens/s (scripts/distributed_check.py)
python3 scripts/distributed_check.py --out "$out/distributed" 2>&1 | tee "$out/distributed.log"
# a GRPO step of SmolLM2-135M's architecture in bf16: generation and update tokens/s against the GPU's bounds
python3 benchmarks/step_throughput.py --device cuda --prompts 16 64 \
  --out "$out/step_throughput_cuda.json" 2>&1 | tee "$out/step_throughput_cuda.log"
# decoding against the GPU's roofline, with and without the decode step as a CUDA graph (cuda_graphs: true)
python3 benchmarks/decode_roofline.py --device cuda --dtype bfloat16 --rows 4 16 64 \
  --out "$out/decode_roofline_cuda_bfloat16.json" 2>&1 | tee "$out/decode_roofline_cuda.log"
[ "${GPU_CHECK_QUICK:-0}" = 1 ] && exit 0  # the checks above only (about 4 minutes on an H200)
python3 benchmarks/grpo_vs_ppo.py --device cuda --sizes medium large --seeds 0 --threads 8 \
  --out "$out/grpo_vs_ppo_cuda.json" --figure "$out/grpo_vs_ppo_cuda.png" 2>&1 | tee "$out/grpo_vs_ppo_cuda.log"
# the whole suite, on this machine's library versions (CPU: the tests build CPU generators)
CUDA_VISIBLE_DEVICES="" python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tail -15 | tee "$out/suite.log"
