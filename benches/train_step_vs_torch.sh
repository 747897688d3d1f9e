#!/usr/bin/env bash
# One off_grpo training step of SmolLM2-135M on CPU in f32: `grpo train` vs PyTorch eager on the same
# batch (1 question x 4 answers of data/trajectories/ot3_math_x8_dev.jsonl), in the same run.
#
#   benches/train_step_vs_torch.sh
#   env: PYTHON (default /work/venv/bin/python; needs torch, transformers, tokenizers, safetensors),
#        BIN (default target/release/grpo, built with `cargo build --release` if missing),
#        MODEL (default tests/fixtures/models/smollm2-135m)
#
# Ours: `grpo -q train` for 3 steps (batch_questions 1, micro_batch_size 4, max_response_tokens 256,
# off_grpo eps 0.2 bias 0.5 beta 0.1 k3, seq-mean-token-mean, AdamW lr 1e-6); step time = median of
# steps 2..3 from OUT/metrics.jsonl (step 1 warms up). PyTorch: the same token ids rebuilt with the
# HF tokenizer (chat template prompt, answer + <|im_end|>, truncated to 256), right-padded; policy
# forward+backward of the same loss (advantage +0.5 for all 4, behaviour prob 1), a frozen reference
# forward (no_grad), AdamW step, zero_grad; sdpa attention, 2 threads; 1 warm-up step then the median
# of 3. tokens/s = (prompt + response tokens, no padding) / step time.
# Output: stdout, also saved to benches/results/train-step-cpu-<date>.{txt,json}.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-/work/venv/bin/python}
BIN=${BIN:-target/release/grpo}
MODEL=${MODEL:-tests/fixtures/models/smollm2-135m}
DATE=$(date +%F)
RES=benches/results
mkdir -p "$RES"
TXT="$RES/train-step-cpu-$DATE.txt"
JSON="$RES/train-step-cpu-$DATE.json"
[ -x "$BIN" ] || cargo build --release --bin grpo -q
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

CPU=$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')
DEVICE="$CPU, nproc $(nproc)"
LOAD0=$(cut -d" " -f1-3 /proc/loadavg)

"$PY" benches/train_step_vs_torch.py prep data/trajectories/ot3_math_x8_dev.jsonl "$WORK/rows.jsonl" 4

cat > "$WORK/config.toml" <<TOML
[model]
path = "$MODEL"
dtype = "f32"
device = "cpu"
[data]
inputs = ["$WORK/rows.jsonl"]
group_size = 4
min_group_size = 2
max_response_tokens = 256
overlong = "truncate"
shuffle = false
[objective]
name = "off_grpo"
eps = 0.2
bias = 0.5
beta = 0.1
kl_estimator = "k3"
loss_agg = "seq-mean-token-mean"
[optim]
name = "adamw"
lr = 1e-6
[train]
output_dir = "$WORK/out"
batch_questions = 1
micro_batch_size = 4
epochs = 0
max_steps = 3
TOML

"$BIN" -q train --config "$WORK/config.toml" > "$WORK/ours.log" 2>&1 || { cat "$WORK/ours.log"; exit 1; }
"$PY" benches/train_step_vs_torch.py torch "$WORK/rows.jsonl" "$MODEL" 256 3 > "$WORK/torch.json" 2> "$WORK/torch.log" \
    || { cat "$WORK/torch.log"; exit 1; }

{
    echo "train step, SmolLM2-135M-Instruct, CPU f32, 1 question x 4 answers, max_response_tokens 256"
    echo "date: $DATE"
    echo "device: $DEVICE"
    echo "load average (1/5/15 min) before: $LOAD0, after: $(cut -d" " -f1-3 /proc/loadavg) (other work on the machine skews timings)"
    echo "grpo: $("$BIN" --version 2>/dev/null || echo "$BIN")"
    echo "python: $("$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
    echo
    "$PY" benches/train_step_vs_torch.py report "$WORK/out/metrics.jsonl" "$WORK/torch.json" "$JSON" "$DEVICE" "$DATE"
} | tee "$TXT"
echo "wrote $TXT and $JSON"
