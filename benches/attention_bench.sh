#!/usr/bin/env bash
# CPU attention at GEMM speed: `grpo bench attention` (forward and backward of one layer's causal
# attention, chunked with GEMM products; 1 row, 16 query heads / 4 KV heads of dim 128, f32, random data)
# at each length, reporting the attention's useful GFLOP/s, the GFLOP/s of a plain 2048^3 f32 matmul
# measured in the same run (candle's matmul, the same `gemm` crate), and their ratio (goal >= 0.25).
#
#   benches/attention_bench.sh     env: BIN (default target/release/grpo), LENGTHS (default "4096 16384"),
#                                       REPEATS (default 1; the 16k run is minutes on 2 cores)
# Output: stdout, also saved to benches/results/attention-gemm-<date>.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/grpo}
LENGTHS=${LENGTHS:-"4096 16384"}
REPEATS=${REPEATS:-1}
[ -x "$BIN" ] || cargo build --release --bin grpo -q
OUT=${OUT:-"benches/results/attention-gemm-$(date +%F).txt"}
{
    echo "date: $(date +%F)"
    echo "device: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), nproc $(nproc), load $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "command: BIN=$BIN LENGTHS=\"$LENGTHS\" REPEATS=$REPEATS benches/attention_bench.sh"
    for len in $LENGTHS; do
        "$BIN" -q bench attention --len "$len" --warmup 0 --repeats "$REPEATS"
    done
    echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$OUT"
