#!/usr/bin/env bash
# Benchmark of `grpo data prepare` (group, label, tokenise with the Qwen3 tokenizer, write shards) on a
# synthetic OpenThoughts3-shaped JSONL file (benches/gen_ot3.py; 16 answers per question, G = 8), not run
# in CI. Prints input MB/s, tokens/s and the peak memory.
#
# usage: benches/data_prepare.sh [SIZE_BYTES] [extra `grpo data prepare` args...]
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE=${1:-1e8}
shift || true
PY=${PYTHON:-/work/venv/bin/python}
[ -x "$PY" ] || PY=python3
DATA=${DATA:-/tmp/grpo-bench-ot3-$SIZE.jsonl}
BIN=${BIN:-${CARGO_TARGET_DIR:-target}/release/grpo}
OUT=$(mktemp -d)
[ -x /usr/bin/time ] || { echo "install GNU time first: apt-get install -y time" >&2; exit 1; }
[ -x "$BIN" ] || cargo build --release
[ -f "$DATA" ] || "$PY" benches/gen_ot3.py "$DATA" "$SIZE"
BYTES=$(stat -c %s "$DATA")
LOG=$(mktemp)
echo "input: $DATA ($BYTES bytes), $(nproc) cores, binary $BIN"
/usr/bin/time -v "$BIN" -q data prepare --input "$DATA" --model data/tokenizers/qwen3 --out "$OUT" "$@" \
    > "$LOG.out" 2> "$LOG"
tail -3 "$LOG.out"
TOKENS=$(grep -o '"tokens": [0-9]*' "$OUT/manifest.json" | awk '{print $2}')
WALL=$(grep "Elapsed (wall clock)" "$LOG" | awk '{print $NF}')
RSS_KB=$(grep "Maximum resident set size" "$LOG" | awk '{print $NF}')
SECS=$(echo "$WALL" | awk -F: '{ if (NF == 3) print $1*3600 + $2*60 + $3; else print $1*60 + $2 }')
awk -v b="$BYTES" -v s="$SECS" -v r="$RSS_KB" -v t="$TOKENS" 'BEGIN {
    printf "wall %.1f s, input %.1f MB/s, %d tokens written (%.0f tokens/s), peak memory (max RSS) %.1f MB\n",
        s, b / 1e6 / s, t, t / s, r / 1024
}'
grep -E "User time|System time|Percent of CPU" "$LOG"
rm -rf "$LOG" "$LOG.out" "$OUT"
