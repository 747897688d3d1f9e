#!/usr/bin/env bash
# Long answers on the CPU: one off_grpo training step (`grpo bench train-step`: policy forward and
# backward, reference forward, AdamW; f32) of a small random Qwen2 model (2 layers, hidden 256, 4 heads /
# 2 KV heads of 64, vocabulary 512) with answers of 1k, 4k and 16k tokens, with flash attention (block by
# block, memory linear in the length) and with the score-matrix path (`--attention matrix`, quadratic), in
# the same run. Time: the bench's step time (no warm-up, 1 step: the lengths differ by 256x in work);
# memory: peak RSS from /usr/bin/time. Prints new/old (flash/matrix) at each length.
#
# The matrix path keeps each layer's [H, T, T] f32 scores and probabilities for the backward
# (2 x 4 x T^2 x 4 bytes per layer), 16 GiB for 2 layers at 16k before any temporary: it runs under a
# virtual-memory cap (ulimit -v, default 12 GiB) and is reported as out of memory at the cap, with that
# requirement, instead of swapping the machine out.
#
#   benches/attention_length.sh        env: BIN (default target/release/grpo), ANSWERS (default 1),
#                                           LENGTHS (default "1024 4096 16384"), CAP_GIB (default 12)
# Output: stdout, also saved to benches/results/attention_length-<date>.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/grpo}
ANSWERS=${ANSWERS:-1}
LENGTHS=${LENGTHS:-"1024 4096 16384"}
CAP_GIB=${CAP_GIB:-12}
[ -x "$BIN" ] || cargo build --release --bin grpo -q
OUT=${OUT:-"benches/results/attention_length-$(date +%F).txt"}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$work/config.json" <<'EOF'
{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "rms_norm_eps": 1e-06,
 "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": true,
 "use_sliding_window": false, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
EOF

# run ATTENTION LEN: prints "seconds rss_mib" or "oom"
run() {
    local attention=$1 len=$2
    if (
        ulimit -v $((CAP_GIB * 1024 * 1024))
        /usr/bin/time -f "%M" -o "$work/rss" "$BIN" -q bench train-step --shape "$work/config.json" \
            --answers "$ANSWERS" --seq-len "$len" --prompt-len 64 --warmup 0 --repeats 1 \
            --attention "$attention" >"$work/out.json" 2>"$work/err"
    ); then
        python3 -c 'import json, sys
d = json.loads(open(sys.argv[1]).read())
assert d["attention"] == sys.argv[3], d
step, rss = d["step_time_s"], int(open(sys.argv[2]).read().split()[-1]) / 1024
print(f"{step:.2f} {rss:.0f}")' \
            "$work/out.json" "$work/rss" "$attention"
    elif grep -qi "memory allocation\|out of memory\|cannot allocate" "$work/err"; then
        echo oom
    else
        cat "$work/err" >&2
        return 1
    fi
}

{
    echo "date: $(date +%F)"
    echo "device: $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), nproc $(nproc), load $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "command: BIN=$BIN ANSWERS=$ANSWERS LENGTHS=\"$LENGTHS\" CAP_GIB=$CAP_GIB $0"
    echo "binary: $BIN; model: 2 layers, hidden 256, 4 heads / 2 KV heads (head dim 64), f32; $ANSWERS answer(s) of LEN tokens (prompt 64) per step; matrix capped at $CAP_GIB GiB"
    printf "%-7s %12s %12s %14s %14s %10s %10s\n" LEN flash_s matrix_s flash_RSS_MiB matrix_RSS_MiB time_new/old mem_new/old
    for len in $LENGTHS; do
        read -r fs fm <<<"$(run flash "$len")"
        m=$(run matrix "$len")
        if [ "$m" = oom ]; then
            need=$(python3 -c "print(f'{2 * 2 * 4 * $len**2 * 4 / 2**30:.0f}')")
            printf "%-7s %12s %12s %14s %14s %10s %10s\n" "$len" "$fs" "oom" "$fm" ">$CAP_GIB GiB" "-" "-"
            echo "        matrix: out of memory at $CAP_GIB GiB (ulimit -v); its kept scores and probabilities alone need $need GiB (2 layers x 2 x 4 heads x T^2 x 4 B)"
        else
            read -r ms mm <<<"$m"
            python3 -c 'import sys
l, fs, ms, fm, mm = sys.argv[1:]
print(f"{l:<7} {fs:>12} {ms:>12} {fm:>14} {mm:>14} {float(fs) / float(ms):>10.2f} {float(fm) / float(mm):>10.2f}")' \
                "$len" "$fs" "$ms" "$fm" "$mm"
        fi
    done
    echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$OUT"
echo "wrote $OUT"
