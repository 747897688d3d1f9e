#!/usr/bin/env bash
# Without arguments (or with --dry-run) this runs scripts/gpu/next-run.sh: the GPU run in one call of at most
# 8 minutes that a session with a lent GPU runs first (docs/cuda.md, "The next GPU run"). With PARTs it runs
# the longer measurements below, part by part.
#
# The GPU measurements of grpo, in one invocation, on a machine with an NVIDIA GPU (builds nothing):
#   0. `grpo selftest --device cuda:0`: every fused kernel, one training step and one generation of a tiny
#      model against the CPU reference, as a table (what a user runs first on a new machine);
#   1. the CUDA kernels' correctness tests against their CPU reference (tests/cuda_ops.rs), and the smoke
#      run of the README (`grpo train` on configs/smoke.toml, then `grpo eval` of its model) on the GPU
#      in bf16;
#   2. the log-prob op alone (fused, chunked; candle's naive log-softmax; PyTorch's naive
#      log_softmax + gather) at vocabulary 151,936, with and without the off_grpo loss on top;
#   3. greedy generation at batch 1 and 32, grpo vs transformers' generate;
#   4. one training step at Qwen2.5-0.5B and 1.5B shapes, 8 answers of 1024, 4096 and 8192 tokens,
#      grpo vs PyTorch eager (transformers, SDPA, autocast bf16);
#   with 3 and 4 also ours with candle's composite ops instead of the fused kernels (--composite-ops),
#   and 4 with the tensor-core attention kernels (--attention mma, and with --atomic-dq --keep-attention),
#   and the warpgroup kernels (--attention wgmma --keep-attention, and with --atomic-dq; on an H100/H200,
#   mma elsewhere);
#   attention: one layer's attention at 4k and 16k tokens, chunked GEMMs, tensor-core and warpgroup kernels
#      (`grpo bench attention [--mma | --wgmma [--atomic-dq]]`, ATTENTION_LENS);
#   5. (part seed7b, not in the default list) one training step at the Qwen2.5-7B shape with random bf16
#      weights and the seed's memory settings (configs/openthinker3.toml: layer recomputation, optimiser
#      state in host memory, no reference model in memory, 2 answers per forward/backward), 8 answers of
#      2048 + 4096 and 2048 + 16384 tokens: the measured peak device memory beside `grpo train --plan`'s.
# Then scripts/gpu/report.py prints the table and writes gpu-<date>.json.
#
#   scripts/gpu/run.sh [--dry-run]    the next GPU run (scripts/gpu/next-run.sh)
#   scripts/gpu/run.sh PART...        PART: selftest tests smoke logprob generate attention train seed7b (all but
#                                     seed7b, which needs an 80 GB card and ~100 GB of host memory)
#
# env: BIN (default gpu-bin/grpo), TESTS (default gpu-bin/cuda_ops), OUTDIR (default $OUT, else
#      benches/results), PYTHON (default python3, with torch and transformers), LIMIT (seconds per
#      measurement, default 420); sizes: LOGPROB_TOKENS (8192), LOGPROB_HIDDEN (896), VOCAB (151936),
#      GEN_SHAPE (qwen2.5-0.5b), NEW_TOKENS (256), TRAIN_SHAPES ("qwen2.5-0.5b qwen2.5-1.5b"),
#      TRAIN_LENS ("1024 4096 8192"), PROMPT_LEN (128), SEED_SHAPE (configs/models/qwen2.5-7b-instruct.
#      config.json), SEED_PROMPT (2048), SEED_LENS ("4096 16384"), SEED_MEMORY (the plan's device memory,
#      80GiB); DEVICE (cuda:0) and TORCH_DEVICE (cuda) for a dry run on the CPU with small sizes (e.g.
#      DEVICE=cpu SEED_SHAPE=scripts/gpu/shapes/tiny.json SEED_PROMPT=16 SEED_LENS=48 run.sh seed7b).
# Build both binaries on a build machine first with scripts/gpu/pack.sh: it leaves gpu-bin/grpo.xz and
# gpu-bin/cuda_ops.xz, which this script unpacks.
# Every measurement appends one JSON line to OUTDIR/gpu-results.jsonl (a failure appends
# {"bench": "error", ...} and the run goes on). Where one call must stay short (a lease of 10 minutes a
# command), run the parts in several calls, e.g. `run.sh tests smoke logprob generate`, then
# `TRAIN_SHAPES=qwen2.5-0.5b run.sh train`, then `TRAIN_SHAPES=qwen2.5-1.5b run.sh train`; concatenate
# their gpu-results.jsonl and run `scripts/gpu/report.py ALL.jsonl benches/results/gpu-<date>.json`.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ $# -eq 0 ] || [ "$1" = --dry-run ]; then
    exec scripts/gpu/next-run.sh "$@"
fi
BIN=${BIN:-gpu-bin/grpo}
TESTS=${TESTS:-gpu-bin/cuda_ops}
OUTDIR=${OUTDIR:-${OUT:-benches/results}}
PY=${PYTHON:-python3}
LIMIT=${LIMIT:-420}
DATE=${DATE:-$(date +%F)}
export DATE
mkdir -p "$OUTDIR"
for f in "$BIN" "$TESTS"; do
    if [ ! -x "$f" ] && [ -f "$f.xz" ]; then
        python3 -c 'import lzma, sys; open(sys.argv[2], "wb").write(lzma.open(sys.argv[1]).read())' "$f.xz" "$f"
        chmod +x "$f"
    fi
    [ -x "$f" ] || { echo "missing $f (build it with scripts/gpu/pack.sh)" >&2; exit 2; }
done
RES="$OUTDIR/gpu-results.jsonl"
LOGPROB_TOKENS=${LOGPROB_TOKENS:-8192}
LOGPROB_HIDDEN=${LOGPROB_HIDDEN:-896}
VOCAB=${VOCAB:-151936}
GEN_SHAPE=${GEN_SHAPE:-qwen2.5-0.5b}
NEW_TOKENS=${NEW_TOKENS:-256}
TRAIN_SHAPES=${TRAIN_SHAPES:-qwen2.5-0.5b qwen2.5-1.5b}
TRAIN_LENS=${TRAIN_LENS:-1024 4096 8192}
PROMPT_LEN=${PROMPT_LEN:-128}
SEED_SHAPE=${SEED_SHAPE:-configs/models/qwen2.5-7b-instruct.config.json}
SEED_PROMPT=${SEED_PROMPT:-2048}
SEED_LENS=${SEED_LENS:-4096 16384}
SEED_MEMORY=${SEED_MEMORY:-80GiB}
DEVICE=${DEVICE:-cuda:0}
TORCH_DEVICE=${TORCH_DEVICE:-cuda}
PARTS=("$@")
ATTENTION_LENS=${ATTENTION_LENS:-4096 16384}

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
    selftest)
        log="$OUTDIR/gpu-selftest.txt"
        if timeout "$LIMIT" "$BIN" -q selftest --device "$DEVICE" >"$log" 2>&1; then ok=true; else ok=false; fi
        cat "$log"
        n=$(grep -c '  pass  ' "$log")
        echo "{\"bench\": \"correctness\", \"what\": \"grpo selftest --device $DEVICE\", \"passed\": $ok, \"tests_ok\": $n}" | tee -a "$RES"
        ;;
    tests)
        log="$OUTDIR/gpu-tests.txt"
        # A GPU that does not open fails the tests here rather than skipping them.
        if GRPO_REQUIRE_CUDA=1 "$TESTS" --test-threads 1 --nocapture >"$log" 2>&1; then ok=true; else ok=false; fi
        cat "$log"
        n=$(grep -c '^test .* ok$' "$log")
        [ "$n" -gt 0 ] || ok=false  # a build without the cuda feature has no tests to run
        echo "{\"bench\": \"correctness\", \"what\": \"tests/cuda_ops.rs\", \"passed\": $ok, \"tests_ok\": $n}" | tee -a "$RES"
        ;;
    smoke)
        work=$(mktemp -d)
        ok=true
        "$BIN" -q train --config configs/smoke.toml --device "$DEVICE" --dtype bf16 \
            --set "train.output_dir=\"$work/run\"" --set "model.path=\"$work/tiny\"" >"$work/train.log" 2>&1 || ok=false
        tail -5 "$work/train.log"
        "$BIN" -q eval --bench aime25 --model "$work/run/best" --limit 4 --n 2 --max-new-tokens 32 --device "$DEVICE" \
            --dtype bf16 --out "$work/eval" >"$work/eval.log" 2>&1 || ok=false
        tail -12 "$work/eval.log"
        "$PY" - "$work" "$ok" "$DEVICE" <<'PYEOF' | tee -a "$RES"
import json, sys
from pathlib import Path
work, ok, device = Path(sys.argv[1]), sys.argv[2] == "true", sys.argv[3]
steps = [json.loads(l) for l in open(work / "run/metrics.jsonl")] if (work / "run/metrics.jsonl").exists() else []
report = json.loads((work / "eval/report.json").read_text()) if (work / "eval/report.json").exists() else None
print(json.dumps({"bench": "smoke", "what": "configs/smoke.toml train + eval aime25 (4 problems x 2), bf16",
                  "device": device, "passed": ok and len(steps) > 0 and report is not None,
                  "losses": [s.get("loss") for s in steps], "grad_norms": [s.get("grad_norm") for s in steps],
                  "peak_gb": [s.get("max_memory_allocated_gb") for s in steps],
                  "eval": report}))
PYEOF
        rm -rf "$work"
        ;;
    logprob)
        for loss in "" --with-loss; do
            common=(--tokens "$LOGPROB_TOKENS" --hidden "$LOGPROB_HIDDEN" --vocab "$VOCAB" --dtype bf16 $loss)
            for mb in 64 1024; do
                measure "logprob fused ${mb}MiB $loss" "$BIN" -q bench logprob "${common[@]}" --chunk-mb $mb \
                    --device "$DEVICE" --repeats 5
            done
            measure "logprob candle naive $loss" "$BIN" -q bench logprob "${common[@]}" --naive --device "$DEVICE" --repeats 5
            measure "logprob torch naive $loss" "$PY" scripts/gpu/torch_ref.py logprob "${common[@]}" \
                --device "$TORCH_DEVICE" --repeats 5
        done
        ;;
    generate)
        for b in 1 32; do
            common=(--shape "$SHAPES/$GEN_SHAPE.json" --batch $b --prompt-len "$PROMPT_LEN" --new-tokens "$NEW_TOKENS" --dtype bf16)
            measure "generate grpo batch $b" "$BIN" -q bench generate "${common[@]}" --device "$DEVICE" --repeats 2
            measure "generate torch batch $b" "$PY" scripts/gpu/torch_ref.py generate "${common[@]}" \
                --device "$TORCH_DEVICE" --repeats 2
            measure "generate grpo composite batch $b" "$BIN" -q bench generate "${common[@]}" --composite-ops \
                --device "$DEVICE" --repeats 2
        done
        ;;
    train)
        for shape in $TRAIN_SHAPES; do
            for len in $TRAIN_LENS; do
                common=(--shape "$SHAPES/$shape.json" --answers 8 --seq-len "$len" --prompt-len "$PROMPT_LEN" --dtype bf16)
                # Without layer recomputation candle keeps every layer's [heads, T, T] attention for the
                # backward: recompute from 4096 tokens on.
                ckpt=()
                [ "$len" -ge 4096 ] && ckpt=(--checkpoint-layers)
                measure "train-step grpo $shape $len" "$BIN" -q bench train-step "${common[@]}" "${ckpt[@]}" \
                    --logprob-chunk-mb 1024 --device "$DEVICE" --warmup 1 --repeats 2
                measure "train-step torch $shape $len" "$PY" scripts/gpu/torch_ref.py train-step "${common[@]}" \
                    --device "$TORCH_DEVICE" --warmup 1 --steps 2
                # The fused kernels against candle's composite ops, and the tensor-core attention
                # kernels against the chunked GEMMs, on the first shape.
                if [ "$shape" = "${TRAIN_SHAPES%% *}" ]; then
                    measure "train-step grpo mma $shape $len" "$BIN" -q bench train-step "${common[@]}" \
                        "${ckpt[@]}" --logprob-chunk-mb 1024 --attention mma --device "$DEVICE" --warmup 1 --repeats 2
                    # and with dq by atomics and the recomputation's attention forward kept
                    # (model.deterministic_attention = false, model.recompute_attention = false)
                    measure "train-step grpo mma-atomic-kept $shape $len" "$BIN" -q bench train-step "${common[@]}" \
                        "${ckpt[@]}" --logprob-chunk-mb 1024 --attention mma --atomic-dq --keep-attention \
                        --device "$DEVICE" --warmup 1 --repeats 2
                    measure "train-step grpo wgmma-kept $shape $len" "$BIN" -q bench train-step "${common[@]}" \
                        "${ckpt[@]}" --logprob-chunk-mb 1024 --attention wgmma --keep-attention \
                        --device "$DEVICE" --warmup 1 --repeats 2
                    measure "train-step grpo wgmma-atomic-kept $shape $len" "$BIN" -q bench train-step \
                        "${common[@]}" "${ckpt[@]}" --logprob-chunk-mb 1024 --attention wgmma --atomic-dq \
                        --keep-attention --device "$DEVICE" --warmup 1 --repeats 2
                    measure "train-step grpo composite $shape $len" "$BIN" -q bench train-step "${common[@]}" \
                        "${ckpt[@]}" --logprob-chunk-mb 1024 --composite-ops --device "$DEVICE" --warmup 1 --repeats 2
                fi
            done
        done
        ;;
    attention)
        # One layer's attention forward + backward at the 7B's head dim (16 heads of 128, groups of 4):
        # the chunked GEMMs against the tensor-core and the warpgroup kernels (the latter also with dq by
        # atomics; the JSON's `kernel` and `atomic_dq` say what ran), each beside a bf16 matmul (the tensor
        # cores' rate), forward and backward also apart (the performance model's two wgmma efficiencies).
        for len in $ATTENTION_LENS; do
            for kernel in chunked mma wgmma wgmma-atomic; do
                flag=(); [ "$kernel" != chunked ] && flag=("--${kernel%-atomic}")
                [ "$kernel" = wgmma-atomic ] && flag+=(--atomic-dq)
                measure "attention $kernel $len" "$BIN" -q bench attention --len "$len" --dtype bf16 "${flag[@]}" \
                    --device "$DEVICE" --warmup 1 --repeats 3
            done
        done
        ;;
    seed7b)
        for len in $SEED_LENS; do
            work=$(mktemp -d)
            # The plan of the seed's config for this micro-batch, on the shape alone (no weights), with the
            # logits recomputed as the bench does (at 4k "auto" would keep them).
            "$BIN" -q train --config configs/openthinker3.toml --plan --model-config "$SEED_SHAPE" --device "$DEVICE" \
                --device-memory "$SEED_MEMORY" --set "data.max_prompt_tokens=$SEED_PROMPT" \
                --set "data.max_response_tokens=$len" --set model.keep_logits=false >"$work/plan.txt" 2>&1
            cat "$work/plan.txt"
            # nvidia-smi's view (context and pool reserve included), sampled every 200 ms.
            smi=
            if command -v nvidia-smi >/dev/null && [ "$DEVICE" != cpu ]; then
                nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$work/smi.txt" &
                smi=$!
            fi
            if timeout "$LIMIT" "$BIN" -q bench train-step --shape "$SEED_SHAPE" --answers 8 \
                --seq-len $((SEED_PROMPT + len)) --prompt-len "$SEED_PROMPT" --micro-batch 2 --checkpoint-layers \
                --offload --no-reference --dtype bf16 --device "$DEVICE" --warmup 0 --repeats 1 \
                >"$work/bench.txt" 2>"$work/bench.err"; then rc=0; else rc=$?; fi
            [ -n "$smi" ] && kill "$smi" 2>/dev/null && wait "$smi" 2>/dev/null
            "$PY" scripts/gpu/seed7b.py "$work" "$rc" "$len" "$SEED_PROMPT" "$DEVICE" "$SEED_SHAPE" | tee -a "$RES"
            rm -rf "$work"
        done
        ;;
    *)
        echo "unknown part $part (selftest tests smoke logprob generate train seed7b)" >&2
        exit 2
        ;;
    esac
done

"$PY" scripts/gpu/report.py "$RES" "$OUTDIR/gpu-$DATE.json" | tee "$OUTDIR/gpu-$DATE.txt"
