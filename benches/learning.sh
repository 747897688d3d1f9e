#!/usr/bin/env bash
# Does training learn? Seed 000's arms (configs/seed000/{sft,off_policy,off_policy_bias,on_policy}.toml) at
# CPU scale on the real SmolLM2-135M-Instruct, on the same train questions and seed, measured on held-out
# questions that no arm trains on, and seed 000's figure (the arms' curves on one figure, `grpo plot`).
#
#   benches/learning.sh            # everything (SEEDS="1 3", the four arms); prints the numbers
#
# What it measures (benches/learning.py has the split and the measure):
# - held-out (3 questions of the bundled dev trajectories whose 8 answers disagree): per answer the mean
#   log-prob per response token of its first 300 characters (`grpo logprobs`); the margin = mean over questions of (mean over its
#   majority answers - mean over its minority answers), and the mean over the majority answers. Before
#   training (step 0) and at each checkpoint (every SAVE_EVERY steps);
# - greedy accuracy on the first EVAL_LIMIT MATH-500 problems with EVAL_TOKENS new tokens at most: `grpo
#   eval` before training, the run's own [validation] (every VALIDATE_EVERY steps and at the end) after.
# Training: 4 questions (2 with disagreeing answers, 2 unanimous; the same in every arm and seed), one
# question a step, EPOCHS epochs (4 steps each), answers truncated to MAX_RESPONSE tokens, lr LR (the seed's 1e-7 for 7B
# moves nothing in 4 steps), the seed configs' objective, KL beta 0.1 and rollout settings otherwise.
#
# Environment: GRPO (binary, default target/release/grpo, else target/debug/grpo), OUT (default runs/learning), SEEDS, ARMS, LR,
# MAX_RESPONSE, ROLLOUT_TOKENS, EVAL_LIMIT (0: no greedy accuracy), EVAL_TOKENS, SAVE_EVERY, VALIDATE_EVERY,
# EPOCHS (default 1), MAX_STEPS (0: EPOCHS x 4), SETS (more --set overrides). Runs under nice.
# The model: tests/fixtures/models/smollm2-135m (scripts/make-smollm2.sh makes it from ../shared).
set -euo pipefail
cd "$(dirname "$0")/.."
# The release binary when built; else the dev one (its dependencies, which do the arithmetic, are
# compiled at opt-level 3 in Cargo.toml's dev profile too).
GRPO=${GRPO:-$( [ -x target/release/grpo ] && echo target/release/grpo || echo target/debug/grpo )}
OUT=${OUT:-runs/learning}
MODEL=${MODEL:-tests/fixtures/models/smollm2-135m}
# Seeds 1 and 2 happen to shuffle the 4 questions into the same order (ChaCha8, train.seed), which makes
# their runs identical; 1 and 3 give different orders.
SEEDS=${SEEDS:-"1 3"}
ARMS=${ARMS:-"sft off_policy off_policy_bias on_policy"}
LR=${LR:-2e-5}
MAX_RESPONSE=${MAX_RESPONSE:-96}
ROLLOUT_TOKENS=${ROLLOUT_TOKENS:-64}
EVAL_LIMIT=${EVAL_LIMIT:-8}
EVAL_TOKENS=${EVAL_TOKENS:-64}
SAVE_EVERY=${SAVE_EVERY:-2}
VALIDATE_EVERY=${VALIDATE_EVERY:-0}
EPOCHS=${EPOCHS:-1}
MAX_STEPS=${MAX_STEPS:-0}
SETS=${SETS:-}   # more overrides for every run, space-separated section.key=value
NICE="nice -n 10"
# EVAL_LIMIT=0: no greedy accuracy (the runs' validation is never due).
[ "$EVAL_LIMIT" -gt 0 ] || VALIDATE_EVERY=1000000000

[ -x "$GRPO" ] || { echo "no $GRPO: cargo build --release --bin grpo" >&2; exit 1; }
[ -f "$MODEL/model.safetensors" ] || scripts/make-smollm2.sh
mkdir -p "$OUT"
python3 benches/learning.py split "$OUT"
log() { echo "[$(date -u +%H:%M:%S)] $*"; }

# Held-out log-probs of the model folder $1, as the step-$2 line of the metrics file $3.
measure() {
  local scored="$OUT/.scored.jsonl"
  $NICE "$GRPO" logprobs --model "$1" --input "$OUT/heldout.jsonl" --output "$scored" --batch-size 4 >/dev/null
  python3 benches/learning.py measure "$scored" "$2" "$3"
}

# Before training: the base model's held-out measure and greedy accuracy (shared by every run).
if [ ! -s "$OUT/base-heldout.jsonl" ]; then
  log "base model: held-out log-probs"
  measure "$MODEL" 0 "$OUT/base-heldout.jsonl"
fi
if [ "$EVAL_LIMIT" -gt 0 ] && [ ! -s "$OUT/base-eval/report.json" ]; then
  log "base model: greedy MATH-500[:$EVAL_LIMIT]"
  $NICE "$GRPO" eval --bench math500 --model "$MODEL" --limit "$EVAL_LIMIT" --n 1 --temperature 0 \
    --max-new-tokens "$EVAL_TOKENS" --batch-size "$EVAL_LIMIT" --out "$OUT/base-eval" >/dev/null
fi

for seed in $SEEDS; do
  for arm in $ARMS; do
    run="$OUT/seed$seed/$arm"
    mkdir -p "$OUT/seed$seed"
    [ -s "$run/heldout.jsonl" ] && [ -s "$run/summary.json" ] && { log "$run: done before"; continue; }
    extra=()
    [ "$arm" = on_policy ] && extra=(--set "rollout.max_new_tokens=$ROLLOUT_TOKENS" --set rollout.batch_size=8)
    for s in $SETS; do extra+=(--set "$s"); done
    log "$run: training"
    start=$(date +%s)
    $NICE "$GRPO" train --config "configs/seed000/$arm.toml" --overwrite \
      --set "model.path=\"$MODEL\"" --set model.dtype=f32 --set model.device=cpu \
      --set model.checkpoint_layers=false --set model.attention=matrix --set optim.offload=false --set "optim.lr=$LR" \
      --set "data.inputs=[\"$OUT/train.jsonl\"]" --set data.max_questions=0 \
      --set "data.prepared_dir=\"$OUT/prepared\"" \
      --set data.max_prompt_tokens=512 --set "data.max_response_tokens=$MAX_RESPONSE" --set data.overlong=truncate \
      --set train.batch_questions=1 --set train.micro_batch_size=4 --set "train.epochs=$EPOCHS" \
      --set "train.max_steps=$MAX_STEPS" \
      --set "train.seed=$seed" --set "train.save_every=$SAVE_EVERY" --set train.keep_last=0 \
      --set 'train.save_dtype="f32"' --set "train.output_dir=\"$run\"" \
      --set 'validation.bench="math500"' --set "validation.limit=$(( EVAL_LIMIT > 0 ? EVAL_LIMIT : 1 ))" --set validation.n=1 \
      --set validation.temperature=0 --set "validation.max_new_tokens=$EVAL_TOKENS" \
      --set "validation.batch_size=$(( EVAL_LIMIT > 0 ? EVAL_LIMIT : 1 ))" \
      --set "validation.every_steps=$VALIDATE_EVERY" \
      "${extra[@]}" 2>"$run.log" || { log "$run: training failed, see $run.log"; tail -5 "$run.log"; exit 1; }
    log "$run: trained in $(( $(date +%s) - start )) s"
    # Step 0 is the base model's (the same weights); then each checkpoint's, whose weights are deleted
    # once measured (1.6 GB each with the optimizer state). The tokenised data and the reference log-probs
    # are prepared once, in $OUT/prepared, for every run.
    rm -f "$run/heldout.jsonl"
    cp "$OUT/base-heldout.jsonl" "$run/heldout.jsonl"
    if [ "$EVAL_LIMIT" -gt 0 ]; then
      mkdir -p "$run/validation"
      cp "$OUT/base-eval/generations.jsonl" "$run/validation/step-00000000-math500.jsonl"
    fi
    for ck in "$run"/checkpoints/step-*/; do
      step=$((10#$(basename "$ck" | sed 's/^step-//')))
      measure "$ck" "$step" "$run/heldout.jsonl"
      rm -rf "$ck"
    done
  done
done

# The numbers, and seed 000's figure from the first seed's runs.
python3 benches/learning.py report "$OUT"
first=${SEEDS%% *}
runs=()
for arm in $ARMS; do runs+=("$OUT/seed$first/$arm"); done
"$GRPO" plot "${runs[@]}" --metrics-file heldout.jsonl \
  --panels heldout/margin,heldout/majority_logprob,loss,reward,kl,grad_norm -o "$OUT/learning.png"
