#!/usr/bin/env bash
# Generation throughput on the CPU, one job under both schedules of the native engine in the same run:
# continuous batching over the paged KV cache (the default) against static batches of whole problems
# (`--schedule static`, what grpo eval ran before the paged engine). SmolLM2-135M-Instruct in f32, the
# first PROBLEMS (16) MATH-500 problems x N (4) sampled answers (temperature 0.6, top_p 0.95, seed 0: the
# same tokens under both schedules), up to MAX_NEW (192) new tokens, BATCH (16) sequences at a time.
# Runs alternate (continuous, static, continuous, static, ...) ROUNDS (2) times; tok/s = generated tokens
# / the generation's wall time in report.json; the ratio is taken per round and its median printed.
#
#   benches/generate_schedules.sh
#   env: BIN (default target/release/grpo, built if missing), MODEL (default
#        tests/fixtures/models/smollm2-135m, made by scripts/make-smollm2.sh), PROBLEMS, N, MAX_NEW, BATCH,
#        ROUNDS.
# Output: stdout, also saved to benches/results/generate-schedules-cpu-<date>.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/grpo}
MODEL=${MODEL:-tests/fixtures/models/smollm2-135m}
PROBLEMS=${PROBLEMS:-16} N=${N:-4} MAX_NEW=${MAX_NEW:-192} BATCH=${BATCH:-16} ROUNDS=${ROUNDS:-2}
DATE=$(date +%F)
TXT=benches/results/generate-schedules-cpu-$DATE.txt
[ -x "$BIN" ] || cargo build --release --bin grpo -q
[ -f "$MODEL/model.safetensors" ] || scripts/make-smollm2.sh
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
COMMON=(--bench math500 --limit "$PROBLEMS" --n "$N" --max-new-tokens "$MAX_NEW" --batch-size "$BATCH"
    --model "$MODEL" --dtype f32 --device cpu)
LOAD0=$(cut -d" " -f1-3 /proc/loadavg)
for r in $(seq "$ROUNDS"); do
    for s in continuous static; do
        "$BIN" eval "${COMMON[@]}" --schedule "$s" --out "$WORK/$s-$r" > "$WORK/$s-$r.log" 2>&1 \
            || { cat "$WORK/$s-$r.log"; exit 1; }
    done
done
{
    echo "generation on the CPU, SmolLM2-135M-Instruct f32, math500 problems 1..$PROBLEMS x $N samples, max_new_tokens $MAX_NEW, batch $BATCH"
    echo "date: $DATE"
    echo "device: $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), nproc $(nproc)"
    echo "load average (1/5/15 min) before: $LOAD0, after: $(cut -d" " -f1-3 /proc/loadavg)"
    echo "grpo: $("$BIN" --version) ($BIN)"
    echo "command: $BIN eval ${COMMON[*]} --schedule {continuous,static}"
    echo
    grep -h "generation:" "$WORK"/continuous-1.log | sed 's/^.*generation:/continuous engine: generation:/' || true
    python3 - "$WORK" "$ROUNDS" <<'PY'
import json, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
ratios = []
print(f"  {'round':>5} {'schedule':<11} {'gen tokens':>10} {'time (s)':>9} {'tok/s':>8} {'avg@n':>6}")
for r in range(1, rounds + 1):
    rep = {s: json.load(open(f"{work}/{s}-{r}/report.json"))["benchmarks"]["math500"] for s in ("continuous", "static")}
    for s, b in rep.items():
        print(f"  {r:>5} {s:<11} {b['generated_tokens']:>10} {b['duration_s']:>9.2f} {b['tokens_per_sec']:>8.1f} {b['avg_at_n']:>6.3f}")
    ratios.append(rep["continuous"]["tokens_per_sec"] / rep["static"]["tokens_per_sec"])
print(f"  continuous / static tok/s per round: {', '.join(f'{x:.2f}x' for x in ratios)}; median {statistics.median(ratios):.2f}x")
PY
} | tee "$TXT"
echo "wrote $TXT"
