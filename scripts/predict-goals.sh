#!/usr/bin/env bash
# The performance model's predictions for issue 41's goals, for this build and for the build the
# 2026-11-26 H100 run measured (--h100-run-build), on the shapes that run measured (scripts/gpu/run.sh):
# the 0.5B shape at 8 answers of 1,024 / 4,096 / 16,384 tokens (reference forward, micro-batch 1, bf16)
# and the seed's 7B step (8 answers of 2,048 + 16,384 tokens, layers recomputed, optimizer offloaded).
# Prints one line per point: step seconds and MFU on the H100 SXM, and the ratio to PyTorch eager where
# that run measured it (1.099 s at 1,024, 1.186 s at 4,096).
set -euo pipefail
cd "$(dirname "$0")/.."
GRPO=${GRPO:-target/debug/grpo}
predict() {  # label, torch seconds or -, args...
  local label=$1 torch=$2; shift 2
  "$GRPO" bench train-step --predict-only --dtype bf16 "$@" 2>/dev/null | python3 -c "
import json, sys
r = json.load(sys.stdin); h = next(p for p in r['predicted'] if p['gpu'].startswith('H100'))
t = '$torch'
ratio = f'{float(t) / h[\"step_time_s\"]:.2f}x PyTorch eager' if t != '-' else ''
print(f'{\"$label\":58s} {h[\"step_time_s\"]:9.3f} s  MFU {100 * h[\"mfu\"]:5.1f}%  {ratio}')"
}
small="--shape scripts/gpu/shapes/qwen2.5-0.5b.json --answers 8 --prompt-len 128 --micro-batch 1 --logprob-chunk-mb 1024"
seven="--shape configs/models/qwen2.5-7b-instruct.config.json --answers 8 --seq-len 18432 --prompt-len 2048 --micro-batch 1 --checkpoint-layers --offload --no-reference"
for build in "h100-run:--h100-run-build --attention flash" "h100-run (wgmma):--h100-run-build --attention wgmma" "this build (auto):"; do
  name=${build%%:*}; flags=${build#*:}
  for t in "1024 1.099" "4096 1.186" "16384 -"; do
    set -- $t
    predict "0.5B 8 x $1, $name" "$2" $small --seq-len "$1" $flags
  done
  predict "7B seed step 8 x 18,432, $name" - $seven $flags
done
