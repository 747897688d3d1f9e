#!/usr/bin/env bash
# Generation throughput on the CPU, same prompts: grpo's native sampler vs llama.cpp's OpenAI-compatible
# server (llama-cpp-python) driven by `grpo eval --engine openai`. SmolLM2-135M-Instruct, the first
# PROBLEMS (8) MATH-500 problems rendered with the model's chat template by grpo, greedy, n 1,
# max_new_tokens MAX_NEW (64).
#
#   benches/engine_vs_native.sh
#   env: BIN (default target/release/grpo, built if missing), PYTHON (a python with
#        `pip install 'llama-cpp-python[server]'`, default python3), MODEL (default
#        tests/fixtures/models/smollm2-135m, made by scripts/make-smollm2.sh from the GGUF),
#        GGUF (default ../shared/data/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf),
#        THREADS (server threads, default nproc), BATCH (native batch size, default PROBLEMS).
#
# Native: f32 weights dequantised from the same Q4_1 GGUF, batch BATCH. Server: the Q4_1 GGUF itself
# (llama.cpp's quantised matmuls), THREADS threads, requests one at a time (--concurrency 1: the
# llama-cpp-python server runs one completion at a time). tok/s = generated tokens / wall time of the
# `grpo eval` run (prefill and scoring included; model loading excluded for the server, included in
# neither's generation time); tokens are the generated texts re-tokenised by grpo for both engines.
# Output: stdout, also saved to benches/results/engine-vs-native-cpu-<date>.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/grpo}
PY=${PYTHON:-python3}
MODEL=${MODEL:-tests/fixtures/models/smollm2-135m}
GGUF=${GGUF:-../shared/data/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${THREADS:-$(nproc)}
PROBLEMS=${PROBLEMS:-8}
BATCH=${BATCH:-$PROBLEMS}
MAX_NEW=${MAX_NEW:-64}
DATE=$(date +%F)
RES=benches/results
TXT="$RES/engine-vs-native-cpu-$DATE.txt"
mkdir -p "$RES"
[ -x "$BIN" ] || cargo build --release --bin grpo -q
[ -f "$MODEL/model.safetensors" ] || scripts/make-smollm2.sh
WORK=$(mktemp -d)
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$PY" -m llama_cpp.server --model "$GGUF" --model_alias smollm2 --host 127.0.0.1 --port "$PORT" \
    --n_ctx 2048 --n_threads "$THREADS" --verbose false > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true; rm -rf "$WORK"' EXIT
for _ in $(seq 240); do
    "$PY" -c "import socket; socket.create_connection(('127.0.0.1', $PORT), 1)" 2>/dev/null && break
    kill -0 $SERVER 2>/dev/null || { cat "$WORK/server.log"; exit 1; }
    sleep 0.5
done

COMMON=(--bench math500 --limit "$PROBLEMS" --n 1 --temperature 0 --max-new-tokens "$MAX_NEW" --model "$MODEL")
LOAD0=$(cut -d" " -f1-3 /proc/loadavg)
"$BIN" -q eval "${COMMON[@]}" --batch-size "$BATCH" --out "$WORK/native" > "$WORK/native.log" 2>&1 \
    || { cat "$WORK/native.log"; exit 1; }
"$BIN" -q eval "${COMMON[@]}" --engine openai --base-url "http://127.0.0.1:$PORT/v1" --served-model smollm2 \
    --concurrency 1 --out "$WORK/server" > "$WORK/server-eval.log" 2>&1 || { cat "$WORK/server-eval.log"; exit 1; }

{
    echo "generation on the CPU, SmolLM2-135M-Instruct, greedy, n 1, max_new_tokens $MAX_NEW, math500 problems 1..$PROBLEMS"
    echo "date: $DATE"
    echo "device: $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), nproc $(nproc)"
    echo "load average (1/5/15 min) before: $LOAD0, after: $(cut -d" " -f1-3 /proc/loadavg) (other work on the machine skews timings)"
    echo "grpo: $("$BIN" --version) ($BIN)"
    echo "server: llama-cpp-python $("$PY" -c 'import llama_cpp; print(llama_cpp.__version__)'), $THREADS threads"
    echo
    "$PY" - "$WORK/native/report.json" "$WORK/server/report.json" "$BATCH" <<'PY'
import json, sys
native, server = (json.load(open(p))["benchmarks"]["math500"] for p in sys.argv[1:3])
print(f"  {'engine':<44} {'gen tokens':>10} {'time (s)':>9} {'tok/s':>8} {'avg@1':>6}")
for name, r in ((f"grpo native (candle, f32, batch {sys.argv[3]})", native),
                ("llama.cpp server (Q4_1, via --engine openai)", server)):
    print(f"  {name:<44} {r['generated_tokens']:>10} {r['duration_s']:>9.2f} {r['tokens_per_sec']:>8.1f} {r['avg_at_n']:>6.3f}")
print(f"  ratio server/native = {server['tokens_per_sec'] / native['tokens_per_sec']:.2f}x")
PY
} | tee "$TXT"
echo "wrote $TXT"
