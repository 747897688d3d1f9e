#!/usr/bin/env bash
# Host syncs of one training step, counted by the code (every read of a device value in the step goes
# through src/device.rs `to_host`): `grpo bench train-step` on the tiny shape (scripts/gpu/shapes/tiny.json)
# with 2 and 8 layers and 1 or 2 answers per micro-batch, 8 answers of 48 tokens. The count is the same on
# any device; the goal is one per step (its statistics read with the gradient norm), whatever the number
# of layers, tensors and micro-batches.
#
#   benches/host_syncs.sh [label]     env: BIN (default target/debug/grpo)
# Output: stdout, also saved to benches/results/host-syncs-<label or date>.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/debug/grpo}
[ -x "$BIN" ] || cargo build --bin grpo -q
OUT="benches/results/host-syncs-${1:-$(date +%F)}.txt"
shapes=$(mktemp -d)
trap 'rm -rf "$shapes"' EXIT
for layers in 2 8; do
    sed "s/\"num_hidden_layers\": 2/\"num_hidden_layers\": $layers/" scripts/gpu/shapes/tiny.json >"$shapes/tiny-$layers-layers.json"
done
{
    echo "date: $(date +%F), commit $(git rev-parse --short HEAD)"
    for layers in 2 8; do
        for micro in 1 2; do
            cmd=(bench train-step --shape "$shapes/tiny-$layers-layers.json" --answers 8 --seq-len 48 --prompt-len 16
                --micro-batch "$micro" --warmup 1 --repeats 1)
            echo "\$ grpo ${cmd[*]/#$shapes\//}"
            "$BIN" -q "${cmd[@]}" | python3 -c 'import json, sys
r = json.loads(sys.stdin.read())
print({k: r[k] for k in ["shape", "micro_batch", "micro_batches", "host_syncs_per_step", "host_syncs_per_micro_batch", "step_time_s"]})'
        done
    done
} | tee "$OUT"
echo "wrote $OUT"
