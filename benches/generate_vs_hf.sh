#!/usr/bin/env bash
# Generation throughput of SmolLM2-135M on CPU, f32, greedy: `grpo eval` vs transformers' generate on the
# same chat-template prompts (the first 16 problems of data/benchmarks/math500.jsonl), at batch 1 (the
# first 4 problems, one after another) and batch 16 (all 16), max_new_tokens 64.
#
#   benches/generate_vs_hf.sh
#   env: PYTHON (default /work/venv/bin/python; needs torch, transformers, tokenizers, safetensors),
#        BIN (default target/release/grpo, built with `cargo build --release` if missing),
#        MODEL (default tests/fixtures/models/smollm2-135m)
#
# Ours: `grpo -q eval --bench-file ... --prompt-template "{problem}" --n 1 --temperature 0`; tokens and
# time from OUT/report.json (duration includes prefill and answer scoring). HF: left padding, pad = eos,
# generate(do_sample=False, eos_token_id=<|im_end|>), sdpa, 2 threads; generated tokens counted per
# sequence up to and excluding the first <|im_end|>; time = wall time of the whole generate loop
# (tokenisation included, model loading excluded). tok/s = generated tokens / time.
# Output: stdout, also saved to benches/results/generate-cpu-<date>.{txt,json}.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-/work/venv/bin/python}
BIN=${BIN:-target/release/grpo}
MODEL=${MODEL:-tests/fixtures/models/smollm2-135m}
MAX_NEW=64
DATE=$(date +%F)
RES=benches/results
mkdir -p "$RES"
TXT="$RES/generate-cpu-$DATE.txt"
JSON="$RES/generate-cpu-$DATE.json"
[ -x "$BIN" ] || cargo build --release --bin grpo -q
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

CPU=$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')
DEVICE="$CPU, nproc $(nproc)"
LOAD0=$(cut -d" " -f1-3 /proc/loadavg)

"$PY" benches/generate_vs_hf.py prep data/benchmarks/math500.jsonl "$WORK/math16.jsonl" 16

ours() { # BATCH LIMIT OUTDIR
    "$BIN" -q eval --bench-file "$WORK/math16.jsonl" --prompt-template "{problem}" --model "$MODEL" \
        --n 1 --temperature 0 --max-new-tokens "$MAX_NEW" --batch-size "$1" --limit "$2" --out "$3" \
        > "$3.log" 2>&1 || { cat "$3.log"; exit 1; }
}
hf() { # BATCH LIMIT OUTFILE
    "$PY" benches/generate_vs_hf.py hf "$WORK/math16.jsonl" "$MODEL" "$MAX_NEW" "$1" "$2" > "$3" 2> "$3.log" \
        || { cat "$3.log"; exit 1; }
}

ours 1 4 "$WORK/ours_b1"
hf 1 4 "$WORK/hf_b1.json"
ours 16 16 "$WORK/ours_b16"
hf 16 16 "$WORK/hf_b16.json"

{
    echo "generation, SmolLM2-135M-Instruct, CPU f32, greedy, max_new_tokens $MAX_NEW, math500 problems 1..16"
    echo "date: $DATE"
    echo "device: $DEVICE"
    echo "load average (1/5/15 min) before: $LOAD0, after: $(cut -d" " -f1-3 /proc/loadavg) (other work on the machine skews timings)"
    echo "grpo: $("$BIN" --version 2>/dev/null || echo "$BIN")"
    echo "python: $("$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
    echo
    "$PY" benches/generate_vs_hf.py report "$DATE" "$DEVICE" "$JSON" \
        1 "$WORK/ours_b1/report.json" "$WORK/hf_b1.json" \
        16 "$WORK/ours_b16/report.json" "$WORK/hf_b16.json"
} | tee "$TXT"
echo "wrote $TXT and $JSON"
