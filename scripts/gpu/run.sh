#!/usr/bin/env bash
# The GPU measurements of grpo, in one invocation, on a machine with an NVIDIA GPU (builds nothing):
#   1. the CUDA kernels' correctness tests against their CPU reference (tests/cuda_ops.rs);
#   2. the log-prob op alone (fused, chunked; candle's naive log-softmax; PyTorch's naive
#      log_softmax + gather) at vocabulary 151,936, with and without the off_grpo loss on top;
#   3. greedy generation at batch 1 and 32, grpo vs transformers' generate;
#   4. one training step at Qwen2.5-0.5B and 1.5B shapes, 8 answers of 1024, 4096 and 8192 tokens,
#      grpo vs PyTorch eager (transformers, SDPA, autocast bf16).
# Then scripts/gpu/report.py prints the table and writes gpu-<date>.json.
#
#   scripts/gpu/run.sh [PART...]      PART: tests logprob generate train-0.5b train-1.5b (default: all)
#
# env: BIN (default gpu-bin/grpo), TESTS (default gpu-bin/cuda_ops: `cargo test --release --features cuda
#      --test cuda_ops --no-run` prints its path), OUTDIR (default $OUT, else benches/results),
#      PYTHON (default python3, with torch and transformers), LIMIT (seconds per measurement, default 420).
# Build both binaries on the build machine first:
#   source ../shared/scripts/cuda-toolchain.sh && cargo build --release --features cuda
#   cargo test --release --features cuda --test cuda_ops --no-run
# Every measurement appends one JSON line to OUTDIR/gpu-results.jsonl (a failure appends
# {"bench": "error", ...} and the run goes on), so several calls can share one results file.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-gpu-bin/grpo}
TESTS=${TESTS:-gpu-bin/cuda_ops}
OUTDIR=${OUTDIR:-${OUT:-benches/results}}
PY=${PYTHON:-python3}
LIMIT=${LIMIT:-420}
DATE=${DATE:-$(date +%F)}
export DATE
mkdir -p "$OUTDIR"
RES="$OUTDIR/gpu-results.jsonl"
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(tests logprob generate train-0.5b train-1.5b)

# The binary links cuBLAS/cuRAND/cudart 13 and finds no RUNPATH: point the loader at them.
if [ -z "${LD_LIBRARY_PATH:-}" ] || ! ldconfig -p | grep -q libcublas.so.13; then
    lib=$(find / -name 'libcublas.so.13' -path '*cu13*' 2>/dev/null | head -1)
    [ -n "$lib" ] && export LD_LIBRARY_PATH="$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

# Run one measurement; its JSON line (or an error line) goes to RES.
measure() {
    local what=$1
    shift
    local log
    log=$(mktemp)
    echo ">> $what" >&2
    if timeout "$LIMIT" "$@" >"$log" 2>"$log.err"; then
        grep '^{' "$log" | tail -1 | tee -a "$RES"
    else
        local rc=$?
        local msg
        msg=$(tail -c 600 "$log.err" | tr '\n"\\' '  /')
        echo "{\"bench\": \"error\", \"what\": \"$what\", \"message\": \"exit $rc: $msg\"}" | tee -a "$RES"
    fi
    rm -f "$log" "$log.err"
}

SHAPES=scripts/gpu/shapes
for part in "${PARTS[@]}"; do
    case $part in
    tests)
        log="$OUTDIR/gpu-tests.txt"
        if "$TESTS" --test-threads 1 --nocapture >"$log" 2>&1; then ok=true; else ok=false; fi
        cat "$log"
        n=$(grep -c '^test .* ok$' "$log")
        echo "{\"bench\": \"correctness\", \"what\": \"tests/cuda_ops.rs\", \"passed\": $ok, \"tests_ok\": $n}" | tee -a "$RES"
        ;;
    logprob)
        for loss in "" --with-loss; do
            common=(--tokens 8192 --hidden 896 --vocab 151936 --dtype bf16 $loss)
            measure "logprob fused 64MiB $loss" "$BIN" -q bench logprob "${common[@]}" --chunk-mb 64 --device cuda:0 --repeats 5
            measure "logprob fused 1GiB $loss" "$BIN" -q bench logprob "${common[@]}" --chunk-mb 1024 --device cuda:0 --repeats 5
            measure "logprob candle naive $loss" "$BIN" -q bench logprob "${common[@]}" --naive --device cuda:0 --repeats 5
            measure "logprob torch naive $loss" "$PY" scripts/gpu/torch_ref.py logprob "${common[@]}" --device cuda --repeats 5
        done
        ;;
    generate)
        for b in 1 32; do
            common=(--shape $SHAPES/qwen2.5-0.5b.json --batch $b --prompt-len 128 --new-tokens 256 --dtype bf16)
            measure "generate grpo batch $b" "$BIN" -q bench generate "${common[@]}" --device cuda:0 --repeats 2
            measure "generate torch batch $b" "$PY" scripts/gpu/torch_ref.py generate "${common[@]}" --device cuda --repeats 2
        done
        ;;
    train-0.5b | train-1.5b)
        shape=$SHAPES/qwen2.5-${part#train-}.json
        for len in 1024 4096 8192; do
            common=(--shape "$shape" --answers 8 --seq-len $len --prompt-len 128 --dtype bf16)
            # Without layer recomputation candle keeps every layer's [heads, T, T] attention for the
            # backward: recompute from 4096 tokens on.
            ckpt=()
            [ "$len" -ge 4096 ] && ckpt=(--checkpoint-layers)
            measure "train-step grpo ${part#train-} $len" "$BIN" -q bench train-step "${common[@]}" "${ckpt[@]}" \
                --logprob-chunk-mb 1024 --device cuda:0 --warmup 1 --repeats 2
            measure "train-step torch ${part#train-} $len" "$PY" scripts/gpu/torch_ref.py train-step "${common[@]}" \
                --device cuda --warmup 1 --steps 2
        done
        ;;
    *)
        echo "unknown part $part (tests logprob generate train-0.5b train-1.5b)" >&2
        exit 2
        ;;
    esac
done

"$PY" scripts/gpu/report.py "$RES" "$OUTDIR/gpu-$DATE.json" | tee "$OUTDIR/gpu-$DATE.txt"
