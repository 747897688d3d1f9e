#!/usr/bin/env bash
# The performance model's predictions for issue 41's goals, for this build and for the build the
# 2026-11-26 H100 run measured (--measured-build benches/results/builds/2026-11-26.toml), on the shapes the H100 runs measured: the 0.5B
# shape at 8 answers of 1,024 and 4,096 tokens and 4 of 16,384 (reference forward, micro-batch 1, bf16),
# and the seed's 7B step (2,048 + 16,384 tokens, layers recomputed, optimizer offloaded) at 4 and 8 answers
# (the seed's), and the seed config as it ships (attention outputs kept). Prints one line per point: step
# seconds and MFU on the H100 SXM, the measured step where there is one (the 2026-11-27b run's build,
# benches/results/gpu-2026-11-27b-h100.jsonl, and its 7B step at 8 answers with attention kept,
# gpu-2026-11-27c-h100.jsonl, predicted as that build ran: --measured-build benches/results/builds/2026-11-27b.toml), and the ratio to PyTorch eager as the 2026-11-27b run measured it (1.053 s
# at 1,024, 0.906 s at 4,096, 1.728 s at 4 x 16,384).
set -euo pipefail
cd "$(dirname "$0")/.."
GRPO=${GRPO:-target/debug/grpo}
predict() {  # label, torch seconds or -, measured seconds or -, args...
  local label=$1 torch=$2 measured=$3; shift 3
  "$GRPO" bench train-step --predict-only --dtype bf16 "$@" 2>/dev/null | python3 -c "
import json, sys
r = json.load(sys.stdin); h = next(p for p in r['predicted'] if p['gpu'].startswith('H100'))
t, m = '$torch', '$measured'
ratio = f'{float(t) / h[\"step_time_s\"]:.2f}x PyTorch eager' if t != '-' else ''
seen = f'measured {float(m):7.3f} s' if m != '-' else ' ' * 17
print(f'{\"$label\":46s} {h[\"step_time_s\"]:8.3f} s  MFU {100 * h[\"mfu\"]:5.1f}%  {seen}  {ratio}')"
}
small="--shape scripts/gpu/shapes/qwen2.5-0.5b.json --prompt-len 128 --micro-batch 1 --logprob-chunk-mb 1024"
seven="--shape configs/models/qwen2.5-7b-instruct.config.json --seq-len 18432 --prompt-len 2048 --micro-batch 1 --checkpoint-layers --offload --no-reference"
for build in "2026-11-26 build:--measured-build benches/results/builds/2026-11-26.toml --attention flash:- - - - -" \
    "2026-11-26 build (wgmma):--measured-build benches/results/builds/2026-11-26.toml --attention wgmma:- - - - -" \
    "2026-11-27b build:--measured-build benches/results/builds/2026-11-27b.toml:0.387 0.752 1.863 - -" "this build, logits recomputed::- - - - -"; do
  name=${build%%:*}; rest=${build#*:}; flags=${rest%%:*}; read -r m1 m4 m16 m7 m7x8 <<<"${rest#*:}"
  predict "0.5B 8 x 1024, $name" 1.053 "$m1" $small --answers 8 --seq-len 1024 $flags
  predict "0.5B 8 x 4096, $name" 0.906 "$m4" $small --answers 8 --seq-len 4096 $flags
  predict "0.5B 4 x 16384, $name" 1.728 "$m16" $small --answers 4 --seq-len 16384 $flags
  predict "7B seed step 4 x 18,432, $name" - "$m7" $seven --answers 4 $flags
  predict "7B seed step 8 x 18,432, $name" - "$m7x8" $seven --answers 8 $flags
done
# This build with the log-prob head's logits kept for its backward (bench --keep-logits: no recomputed lm_head
# GEMM, n V d bytes more): the trainer's default at the 0.5B shape on an 80 GB card (`model.keep_logits =
# "auto"` keeps them where its plan leaves room; not at the 7B shape), as the next GPU run measures it.
predict "0.5B 8 x 1024, this build, logits kept" 1.053 - $small --answers 8 --seq-len 1024 --keep-logits
predict "0.5B 8 x 4096, this build, logits kept" 0.906 - $small --answers 8 --seq-len 4096 --keep-logits
predict "0.5B 4 x 16384, this build, logits kept" 1.728 - $small --answers 4 --seq-len 16384 --keep-logits
# The seed config as it ships now (each layer's attention output kept: recompute_attention = false), at the
# 8 answers the next GPU run measures (scripts/gpu/next-run.sh).
predict "7B seed step 4 x 18,432, attention kept" - - $seven --answers 4 --keep-attention
predict "7B seed step 8 x 18,432, attention kept, 2026-11-27b build" - 24.163 $seven --answers 8 --keep-attention --measured-build benches/results/builds/2026-11-27b.toml
predict "7B seed step 8 x 18,432, attention kept" - - $seven --answers 8 --keep-attention
