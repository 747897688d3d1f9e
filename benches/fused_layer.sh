#!/usr/bin/env bash
# A training step's fused ops against candle's composite ops in the same run, full fine-tuning and LoRA
# (rank 16, every projection), on the CPU: `grpo bench train-step` at the Qwen2.5-0.5B widths with 4 layers
# and a 4,096-token vocabulary, 2 answers of 1,024 tokens, layers recomputed, f32; with BEFORE=<binary>, the
# same fused step of another build beside it (the build before a change). Each line: the median of 3 timed
# steps after a warm-up, the tensors candle made in the step, and the ratio to the composite.
#
#   benches/fused_layer.sh            env: BIN (default target/release/grpo), BEFORE (optional binary)
# Output: stdout, also saved to benches/results/fused-layer-cpu-<date>.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/grpo}
[ -x "$BIN" ] || cargo build --release --bin grpo -q
OUT="benches/results/fused-layer-cpu-$(date +%F).txt"
SHAPE=$(mktemp --suffix .json)
python3 -c 'import json, sys
c = json.load(open("scripts/gpu/shapes/qwen2.5-0.5b.json")); c["num_hidden_layers"] = 4; c["vocab_size"] = 4096
json.dump(c, open(sys.argv[1], "w"))' "$SHAPE"
ARGS=(bench train-step --shape "$SHAPE" --answers 2 --seq-len 1024 --prompt-len 128 --checkpoint-layers
      --warmup 1 --repeats 3)
step() {  # binary, args...: "seconds tensor_ops"
    local bin=$1
    shift
    "$bin" -q "${ARGS[@]}" "$@" | python3 -c 'import json, sys
d = json.load(sys.stdin); print(d["step_time_s"], d["tensor_ops_per_step"])'
}
line() {  # label, "s ops", composite seconds
    read -r s ops <<<"$2"
    python3 -c 'import sys
label, s, ops, ref = sys.argv[1], float(sys.argv[2]), sys.argv[3], float(sys.argv[4])
print(f"{label:<44} step {s:6.2f} s  {ops:>6} tensors  {ref / s:5.2f}x the composite")' "$1" "$s" "$ops" "$3"
}
{
    echo "date: $(date +%F); $(git rev-parse --short HEAD)"
    echo "device: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), nproc $(nproc), load $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "shape: Qwen2.5-0.5B widths, 4 layers, vocab 4096; 2 answers x 1024 tokens; --checkpoint-layers; f32"
    for lora in 0 16; do
        name=$([ "$lora" = 0 ] && echo "every weight" || echo "LoRA r=16")
        composite=$(step "$BIN" --lora-r "$lora" --composite-ops)
        fused=$(step "$BIN" --lora-r "$lora")
        ref=${composite%% *}
        line "$name, composite ops" "$composite" "$ref"
        line "$name, fused ops" "$fused" "$ref"
        if [ -n "${BEFORE:-}" ] && [ "$lora" = 0 ]; then
            line "$name, fused ops, the build before (BEFORE)" "$(step "$BEFORE")" "$ref"
        fi
    done
    echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$OUT"
rm -f "$SHAPE"
