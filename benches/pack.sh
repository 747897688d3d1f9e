#!/usr/bin/env bash
# The padding of a step's micro-batches on long-tailed, OpenThoughts3-like answer lengths (QwQ-32B reasoning:
# a median of a few thousand tokens, a tail cut at 16,384): `grpo bench pack` draws a step of 32 questions x 8
# answers (log-normal lengths, a question's answers alike, fixed seed) and groups it as padded micro-batches of
# 1, 2, 4, 8 answers (train.micro_batch_size) and as packed ones of 16k, 18k, 32k, 64k tokens
# (train.micro_batch_tokens). No model runs: a padded micro-batch computes on rows x its longest answer's
# tokens, a packed one on exactly its answers' tokens.
#
#   benches/pack.sh          env: BIN (default target/release/grpo)
# Output: stdout, also saved to benches/results/packing-<date>.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/grpo}
[ -x "$BIN" ] || cargo build --release --bin grpo -q
OUT="benches/results/packing-$(date +%F).txt"
# A table of one record, then the record.
TABLE=$(cat <<'PY'
import json, sys
r = json.loads(sys.stdin.read())
print(f"{r['answers']} answers (seed {r['seed']}): tokens (prompt + response) median {r['length_median']}, "
      f"p90 {r['length_p90']}, max {r['length_max']}, mean {r['length_mean']:.0f}; {r['cut']} cut at the limit")
print(f"{'grouping':<28} {'micro-batches':>13} {'padding':>8} {'slots/tokens':>13} {'largest (slots)':>16} {'budget fill':>12}")
for g in r["groupings"]:
    fill = "" if g["budget_fill"] is None else f"{100 * g['budget_fill']:.1f}%"
    print(f"{g['batching']:<28} {g['micro_batches']:>13} {100 * g['padding_fraction']:>7.1f}% "
          f"{g['slots'] / g['tokens']:>13.3f} {g['max_slots']:>16} {fill:>12}")
print(json.dumps(r))
PY
)
{
    echo "date: $(date +%F)"
    for args in "--seed 0" "--seed 1" "--seed 0 --median 8192"; do
        echo
        echo "\$ grpo bench pack $args"
        # shellcheck disable=SC2086
        "$BIN" -q bench pack $args | python3 -c "$TABLE"
    done
} | tee "$OUT"
echo "wrote $OUT"
