#!/usr/bin/env bash
# Benchmark of `grpo data stats` on a synthetic OpenThoughts3-shaped JSONL file (not run in CI).
#
# Generates SIZE bytes (default 2.2 GB) of OT3 math rows in /tmp (benches/gen_ot3.py; answers of a question
# spread over 1,024-row windows, a few malformed lines), then runs the release binary under
# `/usr/bin/time -v` and prints the throughput (MB/s) and the peak memory (max RSS). Run it twice with
# different sizes to see that the peak memory does not grow with the input.
#
# usage: benches/data_stats.sh [SIZE_BYTES] [extra `grpo data stats` args...]
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE=${1:-2.2e9}
shift || true
PY=${PYTHON:-/work/venv/bin/python}
[ -x "$PY" ] || PY=python3
DATA=${DATA:-/tmp/grpo-bench-ot3-$SIZE.jsonl}
BIN=${BIN:-${CARGO_TARGET_DIR:-target}/release/grpo}
if [ ! -x /usr/bin/time ]; then
    echo "install GNU time first: apt-get install -y time" >&2
    exit 1
fi
if [ ! -x "$BIN" ]; then
    cargo build --release
fi
if [ ! -f "$DATA" ]; then
    echo "generating $DATA ($SIZE bytes)..."
    "$PY" benches/gen_ot3.py "$DATA" "$SIZE"
fi
BYTES=$(stat -c %s "$DATA")
LOG=$(mktemp)
echo "input: $DATA ($BYTES bytes), $(nproc) cores, binary $BIN"
/usr/bin/time -v "$BIN" -q data stats --input "$DATA" "$@" > "$LOG.out" 2> "$LOG"
cat "$LOG.out"
WALL=$(grep "Elapsed (wall clock)" "$LOG" | awk '{print $NF}')
RSS_KB=$(grep "Maximum resident set size" "$LOG" | awk '{print $NF}')
SECS=$(echo "$WALL" | awk -F: '{ if (NF == 3) print $1*3600 + $2*60 + $3; else print $1*60 + $2 }')
awk -v b="$BYTES" -v s="$SECS" -v r="$RSS_KB" 'BEGIN {
    printf "wall %.1f s, throughput %.1f MB/s, peak memory (max RSS) %.1f MB\n", s, b / 1e6 / s, r / 1024
}'
grep -E "User time|System time|Percent of CPU" "$LOG"
rm -f "$LOG" "$LOG.out"
