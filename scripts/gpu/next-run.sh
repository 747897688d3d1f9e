#!/usr/bin/env bash
# The GPU run of grpo in one call of at most 8 minutes, building nothing: what a session with a lent GPU runs
# first (docs/cuda.md, "The next GPU run"). In priority order, each step under its own `timeout` and all of them
# under DEADLINE seconds (a step that no longer fits is written as skipped):
#   1. `grpo selftest` (every fused kernel, a training step and a generation against the CPU reference);
#   2. the 7B shape with the seed config's memory settings at micro-batch 1 (layers recomputed but their
#      attention kept, optimizer offloaded), SEED_ANSWERS x (2048 + 16384) tokens, --warmup 1 --repeats 2
#      --profile beside nvidia-smi's memory every 200 ms, and the seed config's --plan for the same settings
#      (scripts/gpu/seed7b.py puts them side by side): the MFU goal, first, so that it runs whatever else fits;
#   3. `grpo bench train-step --profile` at the Qwen2.5-0.5B shape, 8 answers x 4k and LONG_ANSWERS x 16k tokens,
#      the trainer's defaults (auto attention: the start-up-checked tensor-core kernels; the log-prob head's
#      logits kept, as model.keep_logits = "auto" chooses there) and every speed option (wgmma,
#      keep-attention, atomic dq);
#   4. PyTorch eager (scripts/gpu/torch_ref.py) at the 0.5B shape, 4k, 16k and 1k tokens, when torch and
#      transformers import (a skipped line otherwise), the 16k one with a step under torch.profiler (its
#      CUDA time in attention, GEMMs and the rest: where PyTorch's step goes), and grpo at 1k beside it;
#   5. one layer's attention at 4k and 16k tokens: chunked GEMMs, tensor-core (mma) and warpgroup (wgmma, and
#      wgmma with dq by atomics) kernels, and the warpgroup ones at head dim 64; Nsight Compute on the
#      warpgroup kernels at 16k, head dims 64 and 128 (issue activity, tensor pipe, occupancy: NAME-ncu.txt);
#      one layer's projection GEMMs at the 7B shape (18k rows) and the 0.5B shape (4k rows), `grpo bench gemm`;
#   6. the offloaded optimizer's host update (`grpo bench optimizer`, fused vs composite) and the same update
#      offloaded from the GPU (staged, overlapped copies vs pageable copies one at a time);
#   7. generation with the paged engine at the 0.5B shape (batch 32, 128, 256; static batches and
#      transformers' generate beside at 32) and the 7B shape at batch 64 with 8k-token prompts;
#   8. last, in the time left: a LoRA step (rank 16 on every projection) at the 0.5B shape and 4k tokens.
# Every train-step line carries the performance model's `predicted` step per GPU (`measured_over_predicted` on
# the card that ran) and its `profile` (of its last step: the step time is the other timed steps', without
# the profiler's syncs); report.py prints the tables and the predicted-vs-measured table.
#
#   scripts/gpu/next-run.sh [--dry-run]
#
# Outputs, named after the date and the card (nvidia-smi's name, e.g. "NVIDIA H100 80GB HBM3" -> h100), in
# OUTDIR (default $OUT where the device tool sets it, else benches/results): gpu-DATE-CARD.jsonl (one JSON line
# a measurement, skip or error), gpu-DATE-CARD.txt (the report), gpu-DATE-CARD.json (report.py's JSON) and
# gpu-DATE-CARD.log (everything printed: selftest table, profile tables, plan); -HHMM is added to the name
# where that day and card have files already.
# --dry-run (or DRY_RUN=1): the same steps on the CPU in f32 with scripts/gpu/shapes/tiny.json and tiny lengths,
# BIN target/debug/grpo, no nvidia-smi and no PyTorch (skipped lines say so), OUTDIR a new temporary folder.
# env: BIN (gpu-bin/grpo, unpacked from gpu-bin/grpo.xz), OUTDIR, DATE, CARD, DEADLINE (450 s), PYTHON
# (python3), SEED_ANSWERS (8), LONG_ANSWERS (4); PARTS (all, or some of: selftest attention ncu gemm profile
# optimizer seed7b torch short generate lora), ATT_KINDS (the 7B heads' attention kernels: chunked mma wgmma wgmma-atomic)
# for a shorter run that measures a change again.
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=${DRY_RUN:-0}
[ "${1:-}" = --dry-run ] && DRY=1
export RUST_BACKTRACE=0
PY=${PYTHON:-python3}
DEADLINE=${DEADLINE:-450}
SEED_ANSWERS=${SEED_ANSWERS:-8}
LONG_ANSWERS=${LONG_ANSWERS:-4}
S=scripts/gpu/shapes
if [ "$DRY" = 1 ]; then
    BIN=${BIN:-target/debug/grpo}
    OUTDIR=${OUTDIR:-$(mktemp -d)}
    DEVICE=cpu DTYPE=f32 CARD=${CARD:-cpu}
    SMALL=$S/tiny.json SEED_SHAPE=$S/tiny.json
    SHORT=32 MID=64 LONG=128 PROMPT=16 ATT_LENS="64 128" SEED_PROMPT=16 SEED_LEN=48 OPT_PARAMS=100000
    GEN_NEW=8 GEN_LONG=64
else
    BIN=${BIN:-gpu-bin/grpo}
    OUTDIR=${OUTDIR:-${OUT:-benches/results}}
    DEVICE=cuda:0 DTYPE=bf16
    SMALL=$S/qwen2.5-0.5b.json SEED_SHAPE=configs/models/qwen2.5-7b-instruct.config.json
    SHORT=1024 MID=4096 LONG=16384 PROMPT=128 ATT_LENS="4096 16384" SEED_PROMPT=2048 SEED_LEN=16384
    OPT_PARAMS=256000000 GEN_NEW=256 GEN_LONG=8192
    if [ ! -x "$BIN" ] && [ -f "$BIN.xz" ]; then
        "$PY" -c 'import lzma, sys; open(sys.argv[2], "wb").write(lzma.open(sys.argv[1]).read())' "$BIN.xz" "$BIN"
        chmod +x "$BIN"
    fi
    # The binary links cuBLAS/cuRAND/cudart 13 without a RUNPATH: the CUDA 13 wheels of the Python
    # environment (and their NCCL, for a binary that still links it), else a system copy.
    lib=$("$PY" -c 'import nvidia, os; r = list(nvidia.__path__)[0]; print(":".join(os.path.join(r, d, "lib") for d in ("cu13", "nccl")))' 2>/dev/null)
    [ -e "${lib%%:*}/libcublas.so.13" ] || lib=$(find /opt /usr/local /usr/lib -name 'libcublas.so.13' 2>/dev/null | head -1 | xargs -r dirname)
    [ -n "$lib" ] && export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
    # "NVIDIA H100 80GB HBM3" -> h100, "NVIDIA A100-SXM4-80GB" -> a100; else the whole name as a slug.
    CARD=${CARD:-$("$PY" -c 'import re, sys
n = re.sub(r"^NVIDIA\s+", "", sys.argv[1].strip())
m = re.search(r"\b([A-Za-z]+\d+[A-Za-z]*)\b", n)
print((m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", n.lower()).strip("-")).lower() or "gpu")' "$GPU_NAME")}
fi
[ -x "$BIN" ] || { echo "missing $BIN (build it with scripts/gpu/pack.sh and carry gpu-bin)" >&2; exit 2; }
# A binary that does not start (a library missing) would fail every step: say why and stop at once.
if ! "$BIN" --version >/dev/null 2>&1; then
    "$BIN" --version 2>&1 | tail -3
    ldd "$BIN" 2>&1 | grep -i 'not found'
    exit 3
fi
DATE=${DATE:-$(date -u +%F)}
export DATE
mkdir -p "$OUTDIR"
NAME="$OUTDIR/gpu-$DATE-$CARD"
# A second run on one card and day keeps the first one's files.
[ -e "$NAME.jsonl" ] && NAME="$NAME-$(date -u +%H%M)"
R="$NAME.jsonl"
: >"$R"
exec > >(tee "$NAME.log") 2>&1
TMP=$(mktemp -d)
echo "grpo next GPU run: $DATE, card $CARD, device $DEVICE, binary $BIN ($("$BIN" --version 2>&1)), outputs $NAME.*"
[ "$DRY" = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader

jstr() { "$PY" -c 'import json, sys; print(json.dumps(sys.stdin.read()))'; }
skip() { # skip WHAT REASON
    echo "{\"bench\": \"skipped\", \"what\": \"$1\", \"reason\": \"$2\"}" | tee -a "$R"
}
# want PART: whether PARTS (default all) names this part of the run.
want() { [ "${PARTS:-all}" = all ] || [[ " $PARTS " == *" $1 "* ]]; }
# step NAME LIMIT CMD...: under the smaller of LIMIT and the time left; its last JSON line, or an error line, to R.
# Its stderr (the profile table) goes to the log.
step() {
    local name=$1 lim=$2
    shift 2
    local left=$((DEADLINE - SECONDS))
    if [ $left -lt 15 ]; then skip "$name" "no time left (deadline $DEADLINE s)"; return; fi
    [ "$lim" -gt $left ] && lim=$left
    echo ">> [$SECONDS s] $name (limit $lim s)"
    local t0=$SECONDS rc line
    timeout "$lim" "$@" >"$TMP/out" 2>"$TMP/err"
    rc=$?
    line=$(grep '^{' "$TMP/out" | tail -1)
    if [ $rc = 0 ] && [ -n "$line" ]; then
        cat "$TMP/err"
        echo "$line" >>"$R"
        echo "$line" | cut -c1-400
    else
        echo "{\"bench\": \"error\", \"what\": \"$name\", \"message\": $( (echo "exit $rc"; tail -c 700 "$TMP/err") | jstr)}" | tee -a "$R"
    fi
    echo "   ($((SECONDS - t0)) s)"
}

# 1. selftest
if want selftest; then
    echo ">> [$SECONDS s] selftest"
    if timeout 90 "$BIN" -q selftest --device "$DEVICE" >"$TMP/selftest" 2>&1; then ok=true; else ok=false; fi
    cat "$TMP/selftest"
    echo "{\"bench\": \"correctness\", \"what\": \"grpo selftest --device $DEVICE\", \"passed\": $ok, \"tests_ok\": $(grep -c '  pass  ' "$TMP/selftest")}" | tee -a "$R"
fi

# 2. the 7B shape with the seed's settings at micro-batch 1, beside nvidia-smi and the plan
if want seed7b; then
    W=$TMP/seed7b
    mkdir -p "$W"
    # (the logits recomputed, as the bench beside it does: "auto" would keep them at a shorter SEED_LEN)
    "$BIN" -q train --config configs/openthinker3.toml --plan --model-config "$SEED_SHAPE" --device "$DEVICE" \
        --device-memory 80GiB --set "data.max_prompt_tokens=$SEED_PROMPT" --set "data.max_response_tokens=$SEED_LEN" \
        --set train.micro_batch_size=1 --set model.keep_logits=false >"$W/plan.txt" 2>&1
    cat "$W/plan.txt"
    smi=
    if [ "$DRY" = 1 ]; then
        skip "nvidia-smi memory sampling" "dry run on the CPU"
    else
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$W/smi.txt" &
        smi=$!
    fi
    step "train-step grpo 7b seed mb1 $SEED_ANSWERS x $((SEED_PROMPT + SEED_LEN))" 240 "$BIN" -q bench train-step \
        --shape "$SEED_SHAPE" --answers "$SEED_ANSWERS" --seq-len $((SEED_PROMPT + SEED_LEN)) --prompt-len "$SEED_PROMPT" \
        --micro-batch 1 --checkpoint-layers --keep-attention --offload --no-reference --dtype "$DTYPE" --device "$DEVICE" \
        --warmup 1 --repeats 2 --profile
    [ -n "$smi" ] && kill "$smi" 2>/dev/null && wait "$smi" 2>/dev/null
    # seed7b.py reads the bench's output as bench.txt; its exit status is that of the step (an error line: 1).
    last=$(tail -1 "$R")
    case $last in *'"train_step"'*) rc=0 ;; *) rc=1 ;; esac
    cp "$TMP/out" "$W/bench.txt" 2>/dev/null
    cp "$TMP/err" "$W/bench.err" 2>/dev/null
    "$PY" scripts/gpu/seed7b.py "$W" "$rc" "$SEED_LEN" "$SEED_PROMPT" "$DEVICE" "$SEED_SHAPE" "$SEED_ANSWERS" | tee -a "$R"
fi

# 3. the profile at the 0.5B shape
c=(--shape "$SMALL" --prompt-len "$PROMPT" --dtype "$DTYPE" --logprob-chunk-mb 1024 --device "$DEVICE" --profile)
fast=(--attention wgmma --keep-attention --atomic-dq --keep-logits)
# The default lines keep the log-prob head's logits (--keep-logits): what `model.keep_logits = "auto"`, the
# trainer's default, chooses at the 0.5B shape on an 80 GB card (its plan: 22 GiB with them at 16k).
if want profile; then
    step "train-step grpo 0.5b $MID" 60 "$BIN" -q bench train-step "${c[@]}" --keep-logits --answers 8 --seq-len $MID \
        --warmup 1 --repeats 2
    step "train-step grpo wgmma 0.5b $MID" 60 "$BIN" -q bench train-step "${c[@]}" "${fast[@]}" --answers 8 --seq-len $MID \
        --warmup 1 --repeats 2
    step "train-step grpo 0.5b $LONG x $LONG_ANSWERS" 75 "$BIN" -q bench train-step "${c[@]}" --keep-logits \
        --answers "$LONG_ANSWERS" --seq-len $LONG --warmup 1 --repeats 2
    step "train-step grpo wgmma 0.5b $LONG x $LONG_ANSWERS" 75 "$BIN" -q bench train-step "${c[@]}" "${fast[@]}" \
        --answers "$LONG_ANSWERS" --seq-len $LONG --warmup 1 --repeats 2
fi

# 4. PyTorch eager at the 0.5B shape, and grpo at 1k beside it
if want torch; then
    t=(--shape "$SMALL" --prompt-len "$PROMPT" --dtype "$DTYPE" --device cuda --warmup 1)
    if [ "$DRY" = 1 ]; then
        skip "torch_ref.py train-step $MID $LONG $SHORT" "dry run on the CPU (PyTorch not run)"
    elif ! "$PY" -c 'import torch, transformers; assert torch.cuda.is_available()' 2>/dev/null; then
        skip "torch_ref.py train-step $MID $LONG $SHORT" "torch and transformers with CUDA do not import in $PY"
    else
        step "train-step torch 0.5b $MID" 60 "$PY" scripts/gpu/torch_ref.py train-step "${t[@]}" --answers 8 --seq-len $MID --steps 2
        step "train-step torch 0.5b $LONG x $LONG_ANSWERS" 75 "$PY" scripts/gpu/torch_ref.py train-step "${t[@]}" \
            --answers "$LONG_ANSWERS" --seq-len $LONG --steps 1 --profile
        step "train-step torch 0.5b $SHORT" 45 "$PY" scripts/gpu/torch_ref.py train-step "${t[@]}" --answers 8 --seq-len $SHORT --steps 2
fi
fi
if want short; then
    step "train-step grpo 0.5b $SHORT" 30 "$BIN" -q bench train-step "${c[@]}" --keep-logits --answers 8 --seq-len $SHORT --warmup 1 --repeats 2
fi

# 5. attention, one layer at the 7B's heads
if want attention; then
    for len in $ATT_LENS; do
        for k in ${ATT_KINDS:-chunked mma wgmma wgmma-atomic}; do
            f=()
            [ $k != chunked ] && f=("--${k%-atomic}")
            [ $k = wgmma-atomic ] && f+=(--atomic-dq)
            step "attention $k $len" 40 "$BIN" -q bench attention --len "$len" --dtype "$DTYPE" "${f[@]}" --device "$DEVICE" \
                --warmup 1 --repeats 3
        done
    done

    # 5a. the same at the 0.5B shape's heads (14 of 64, GQA 7): the rates at head dim 64, with a dq kernel (what
    # `model.attention = "auto"` runs by default) and with dq by atomics
    for len in $ATT_LENS; do
        for k in wgmma wgmma-atomic; do
            f=(--wgmma)
            [ $k = wgmma-atomic ] && f+=(--atomic-dq)
            step "attention $k hd64 $len" 40 "$BIN" -q bench attention --len "$len" --heads 14 --kv-heads 2 \
                --head-dim 64 --dtype "$DTYPE" "${f[@]}" --device "$DEVICE" --warmup 1 --repeats 3
        done
    done
fi

# 5c. Nsight Compute on the warpgroup kernels at 16k tokens, head dims 64 (the 0.5B's heads) and 128 (the 7B's):
# each kernel's duration, its schedulers' issue activity and instructions, its warps' stall reasons (barriers,
# waits for wgmma), its tensor pipe's activity and its occupancy, to check the reading that their steps are
# bound by issuing instructions and, in the backward, by stalls (scripts/attention-issue-model.py). The card's clocks are left alone (--clock-control none); the text goes to NAME-ncu.txt.
if want ncu; then
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    if [ "$DRY" = 1 ]; then
        skip "ncu on the warpgroup attention kernels" "dry run on the CPU"
    elif [ -z "$NCU" ]; then
        skip "ncu on the warpgroup attention kernels" "ncu is not on this machine"
    elif [ $((DEADLINE - SECONDS)) -lt 60 ]; then
        skip "ncu on the warpgroup attention kernels" "no time left (deadline $DEADLINE s)"
    else
        for hd in 64 128; do
            heads=(--heads 16 --kv-heads 4)
            [ $hd = 64 ] && heads=(--heads 14 --kv-heads 2)
            echo ">> [$SECONDS s] ncu attention wgmma hd$hd ${ATT_LENS##* } (limit 45 s)"
            timeout 45 "$NCU" --clock-control none --kernel-name regex:flash_wgmma_ --launch-count 3 \
                --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section InstructionStats \
                --section Occupancy \
                "$BIN" -q bench attention --len "${ATT_LENS##* }" "${heads[@]}" --head-dim $hd --dtype "$DTYPE" --wgmma \
                --device "$DEVICE" --warmup 0 --repeats 1 >"$TMP/ncu" 2>&1
            rc=$?
            { echo "== head dim $hd (exit $rc)"; cat "$TMP/ncu"; } >>"$NAME-ncu.txt"
            grep -E "flash_wgmma_|Duration|Issue Slots Busy|Issued Warp|Executed Ipc|Achieved Occupancy|Compute \(SM\) Throughput|Registers|Warp Cycles Per Issued" \
                "$TMP/ncu" | head -40
            echo "{\"bench\": \"ncu\", \"what\": \"warpgroup attention kernels, head dim $hd\", \"exit\": $rc, \"file\": \"$(basename "$NAME")-ncu.txt\"}" | tee -a "$R"
        done
        # The sections print the stall reasons only as a chart: the backward's reasons at head dim 64 (the
        # 0.5B's 16k step: a scheduler with two warps, issuing a third of its cycles) as metrics, each the
        # warps stalled for it per issued instruction. A call of its own, so that a metric this ncu lacks
        # loses only these lines.
        stalls=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' long_scoreboard short_scoreboard \
            wait barrier membar math_pipe_throttle mio_throttle lg_throttle not_selected selected dispatch_stall \
            no_instruction branch_resolving sleeping tex_throttle drain misc)
        if [ $((DEADLINE - SECONDS)) -ge 40 ]; then
            echo ">> [$SECONDS s] ncu stall reasons, attention wgmma backward hd64 ${ATT_LENS##* } (limit 30 s)"
            timeout 30 "$NCU" --clock-control none --kernel-name regex:flash_wgmma_bwd_ --launch-count 2 \
                --metrics "${stalls%,}" \
                "$BIN" -q bench attention --len "${ATT_LENS##* }" --heads 14 --kv-heads 2 --head-dim 64 --dtype "$DTYPE" \
                --wgmma --device "$DEVICE" --warmup 0 --repeats 1 >"$TMP/ncu" 2>&1
            rc=$?
            { echo "== stall reasons, backward, head dim 64 (exit $rc)"; cat "$TMP/ncu"; } >>"$NAME-ncu.txt"
            grep -E "flash_wgmma_|issue_stalled" "$TMP/ncu" | head -40
            echo "{\"bench\": \"ncu\", \"what\": \"warpgroup attention backward's stall reasons, head dim 64\", \"exit\": $rc, \"file\": \"$(basename "$NAME")-ncu.txt\"}" | tee -a "$R"
        else
            skip "ncu stall reasons of the warpgroup attention backward" "no time left (deadline $DEADLINE s)"
        fi
    fi
fi

# 5b. one layer's projection GEMMs at the 7B shape over a 16k micro-batch and at the 0.5B shape over 4k: the
# rates the performance model's single GEMM efficiency (measured at 2048^3) stands for at the step's shapes
if want gemm; then
    step "gemm 7b $((SEED_PROMPT + SEED_LEN))" 40 "$BIN" -q bench gemm --shape "$SEED_SHAPE" \
        --tokens $((SEED_PROMPT + SEED_LEN)) --dtype "$DTYPE" --device "$DEVICE" --warmup 1 --repeats 3
    step "gemm 0.5b $MID" 20 "$BIN" -q bench gemm --shape "$SMALL" --tokens $MID --dtype "$DTYPE" --device "$DEVICE" \
        --warmup 1 --repeats 3
fi

# 6. the offloaded optimizer
if want optimizer; then
    # The offloaded optimizer's host update on this machine's CPUs, fused against the composite ops it replaced
    # (the performance model's host rate is predicted from the 2-core CI machine's ratio).
    step "optimizer host update" 40 "$BIN" -q bench optimizer --params "$OPT_PARAMS" --tensors 256 --dtype bf16 \
        --warmup 1 --repeats 2
    # The same update offloaded from the GPU: gradients down and weights up through the page-locked staging,
    # overlapped with the host's update (src/train/offload.rs), against the copies one tensor at a time through
    # pageable memory that the H100 run's build made.
    step "optimizer offloaded from $DEVICE" 45 "$BIN" -q bench optimizer --params "$OPT_PARAMS" --tensors 256 \
        --dtype "$DTYPE" --device "$DEVICE" --warmup 1 --repeats 2
fi

# 7. generation: the paged engine (continuous batching, the default) at the 0.5B shape, batch 32, 128 and
# 256, PROMPT prompt tokens and GEN_NEW new tokens each (random weights never stop), with static batches
# (what grpo generated with before) and transformers' generate beside at batch 32; then the 7B shape at batch
# 64 with GEN_LONG-token prompts (the decode step against reading the weights and the cache). Each record
# carries the model's predicted decode step (predicted_decode_step).
if want generate; then
    g=(--prompt-len $PROMPT --new-tokens $GEN_NEW --dtype "$DTYPE" --device "$DEVICE" --warmup 1 --repeats 2)
    for b in 32 128 256; do
        step "generate grpo 0.5b batch $b" 40 "$BIN" -q bench generate --shape "$SMALL" --batch $b "${g[@]}"
    done
    step "generate grpo static 0.5b batch 32" 40 "$BIN" -q bench generate --shape "$SMALL" --batch 32 \
        --schedule static "${g[@]}"
    if [ "$DRY" = 1 ]; then
        skip "generate torch 0.5b batch 32" "dry run on the CPU (PyTorch not run)"
    elif "$PY" -c 'import torch, transformers; assert torch.cuda.is_available()' 2>/dev/null; then
        step "generate torch 0.5b batch 32" 60 "$PY" scripts/gpu/torch_ref.py generate --shape "$SMALL" --batch 32 \
            --prompt-len $PROMPT --new-tokens $GEN_NEW --dtype "$DTYPE" --device cuda --repeats 2
    else
        skip "generate torch 0.5b batch 32" "torch and transformers with CUDA do not import in $PY"
    fi
    step "generate grpo 7b batch 64 x $GEN_LONG" 60 "$BIN" -q bench generate --shape "$SEED_SHAPE" --batch 64 \
        --prompt-len $GEN_LONG --new-tokens 32 --dtype "$DTYPE" --device "$DEVICE" --warmup 0 --repeats 1
fi

# 8. the LoRA step (rank 16 on every projection, as configs/openthinker3-lora.toml) at the 0.5B shape and 4k,
# last, in what time is left: its element-wise kernels (kernels/lora.cu, 16-byte packs) against the model's
# packed rate.
if want lora; then
    step "train-step grpo lora r16 0.5b $MID" 45 "$BIN" -q bench train-step "${c[@]}" --lora-r 16 --answers 8 \
        --seq-len $MID --warmup 1 --repeats 2
fi

# The report: tables, the predicted-vs-measured table, and its JSON.
"$PY" scripts/gpu/report.py "$R" "$NAME.json" >"$NAME.txt" 2>&1
cat "$NAME.txt"
rm -rf "$TMP"
echo "done at $SECONDS s: $NAME.{jsonl,txt,json,log}"
