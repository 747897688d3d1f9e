#!/usr/bin/env bash
# Picking the next token from 151,936 logits (Qwen vocabulary), 32 rows per run: `grpo bench sample` times
# ours (partial selection of the nucleus) against the full-sort reference in the same process, for the
# eval defaults (temperature 0.6, top-p 0.95), top-k 50 + top-p 0.9, and no truncation.
#
#   benches/sample.sh          env: BIN (default target/release/grpo)
# Output: stdout, also saved to benches/results/sample-cpu-<date>.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/grpo}
[ -x "$BIN" ] || cargo build --release --bin grpo -q
OUT="benches/results/sample-cpu-$(date +%F).txt"
{
    echo "date: $(date +%F)"
    echo "device: $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), nproc $(nproc), load $(cut -d' ' -f1-3 /proc/loadavg)"
    for args in "--temperature 0.6 --top-p 0.95" "--temperature 1.0 --top-k 50 --top-p 0.9" "--temperature 1.0 --top-p 1.0"; do
        # shellcheck disable=SC2086
        "$BIN" -q bench sample $args --repeats 5
    done
} | tee "$OUT"
echo "wrote $OUT"
