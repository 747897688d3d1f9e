#!/usr/bin/env bash
# Throughput of `grpo score` against Math-Verify (Python) on the same (gold, response) pairs, in one run.
#
#   benches/score_throughput.sh [N_PAIRS]        (default 8000)
#   env: PYTHON (default /work/venv/bin/python, needs math-verify), PROFILE (default release),
#        CARGO_TARGET_DIR (default target)
#
# The pairs are the 400 dev responses of tests/fixtures/reward/math_x8_dev.jsonl plus the Math-Verify
# corpus cases wrapped as "... \boxed{pred}.", repeated up to N. Math-Verify runs single-threaded
# (its timeout uses signals): verify(parse("\boxed{gold}"), parse(response)) per pair. grpo score
# runs once with all cores and once with RAYON_NUM_THREADS=1 (per-core ratio). Both times include
# start-up and I/O. Also prints how often the two verdicts agree on these pairs.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-8000}
PY=${PYTHON:-/work/venv/bin/python}
PROFILE=${PROFILE:-release}
TARGET=${CARGO_TARGET_DIR:-target}
cargo build --profile "$PROFILE" --bin grpo -q
case "$PROFILE" in dev) DIR=debug ;; *) DIR=$PROFILE ;; esac
BIN="$TARGET/$DIR/grpo"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

"$PY" - "$N" > "$WORK/pairs.jsonl" <<'PYEOF'
import json, sys
n = int(sys.argv[1])
pairs = []
for line in open("tests/fixtures/reward/math_x8_dev.jsonl"):
    d = json.loads(line)
    pairs += [(d["gt"], r) for r in d["responses"]]
for line in open("tests/fixtures/reward/mathverify_cases.jsonl"):
    d = json.loads(line)
    pairs.append((d["gold"], "So the final answer is \\boxed{" + d["pred"] + "}."))
for i in range(n):
    g, r = pairs[i % len(pairs)]
    print(json.dumps({"id": i, "answer": g, "response": r}))
PYEOF

now() { date +%s.%N; }

t0=$(now)
"$BIN" -q score --input "$WORK/pairs.jsonl" --output "$WORK/rust.jsonl" > /dev/null
t1=$(now)
RAYON_NUM_THREADS=1 "$BIN" -q score --input "$WORK/pairs.jsonl" --output "$WORK/rust1.jsonl" > /dev/null
t2=$(now)

t3=$(now)
"$PY" - "$WORK/pairs.jsonl" "$WORK/mv.jsonl" <<'PYEOF'
import json, sys, logging
logging.disable(logging.WARNING)
from math_verify import parse, verify
out = open(sys.argv[2], "w")
for line in open(sys.argv[1]):
    d = json.loads(line)
    try:
        v = bool(verify(parse("\\boxed{" + d["answer"] + "}"), parse(d["response"])))
    except Exception:
        v = False
    out.write(json.dumps(v) + "\n")
PYEOF
t4=$(now)

"$PY" - "$N" "$t0" "$t1" "$t2" "$t3" "$t4" "$WORK/rust.jsonl" "$WORK/mv.jsonl" "$PROFILE" <<'PYEOF'
import json, sys, os, platform
n = int(sys.argv[1]); t0, t1, t2, t3, t4 = map(float, sys.argv[2:7])
rust = [json.loads(l)["correct"][0] for l in open(sys.argv[7])]
mv = [json.loads(l) for l in open(sys.argv[8])]
agree = sum(a == b for a, b in zip(rust, mv))
rs, r1, py = n / (t1 - t0), n / (t2 - t1), n / (t4 - t3)
print(f"pairs: {n}  profile: {sys.argv[9]}  cores: {os.cpu_count()}  cpu: {platform.processor() or platform.machine()}")
print(f"grpo score (all cores):   {t1 - t0:8.3f} s  {rs:10.0f} pairs/s")
print(f"grpo score (1 thread):    {t2 - t1:8.3f} s  {r1:10.0f} pairs/s")
print(f"Math-Verify (1 process):  {t4 - t3:8.3f} s  {py:10.0f} pairs/s")
print(f"ratio (all cores / Math-Verify): {rs / py:8.1f}x")
print(f"ratio (1 thread / Math-Verify):  {r1 / py:8.1f}x")
print(f"verdict agreement with Math-Verify on these pairs: {agree}/{n} ({100 * agree / n:.2f}%)")
PYEOF
