#!/usr/bin/env bash
# The fused RMSNorm, rope and attention-softmax ops against candle's composite ops (their references), in
# the same run: one off_grpo training step (`grpo bench train-step`, f32, CPU) of
#   - the tiny Qwen2 shape (scripts/gpu/shapes/tiny.json), 2 answers of 2048 tokens: attention-bound;
#   - the SmolLM2-135M shape, 4 answers of 333 tokens (the shape of benches/train_step_vs_torch.sh).
# Each: 1 warm-up + 2 timed steps, median; peak RSS from /usr/bin/time.
#
#   benches/fused_ops.sh          env: BIN (default target/release/grpo)
# Output: stdout, also saved to benches/results/fused-ops-cpu-<date>.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/grpo}
[ -x "$BIN" ] || cargo build --release --bin grpo -q
OUT="benches/results/fused-ops-cpu-$(date +%F).txt"
run() {
    local label=$1
    shift
    local log
    log=$(mktemp)
    /usr/bin/time -f "%M" -o "$log.rss" "$BIN" -q bench train-step "$@" --warmup 1 --repeats 2 >"$log"
    python3 -c 'import json, sys
d = json.loads(open(sys.argv[1]).read())
rss = int(open(sys.argv[2]).read().split()[-1]) / 1024
step, tps = d["step_time_s"], d["tokens_per_s"]
print(f"{sys.argv[3]:<34} step {step:7.2f} s  {tps:8.1f} tok/s  peak RSS {rss:7.0f} MiB")' \
        "$log" "$log.rss" "$label"
    rm -f "$log" "$log.rss"
}
{
    echo "date: $(date +%F)"
    echo "device: $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), nproc $(nproc), load $(cut -d' ' -f1-3 /proc/loadavg)"
    tiny=(--shape scripts/gpu/shapes/tiny.json --answers 2 --seq-len 2048 --prompt-len 64)
    smol=(--shape tests/fixtures/models/smollm2-135m/config.json --answers 4 --seq-len 333 --prompt-len 77 --micro-batch 4)
    run "tiny 2 x 2048, fused" "${tiny[@]}"
    run "tiny 2 x 2048, composite" "${tiny[@]}" --composite-ops
    if [ -f tests/fixtures/models/smollm2-135m/config.json ]; then
        run "SmolLM2-135M 4 x 333, fused" "${smol[@]}"
        run "SmolLM2-135M 4 x 333, composite" "${smol[@]}" --composite-ops
    fi
    echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$OUT"
echo "wrote $OUT"
