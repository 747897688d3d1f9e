#!/usr/bin/env bash
# Whether a change kept training's numbers bit for bit on the CPU: the smoke run (configs/smoke.toml, 4
# steps), one step of every objective on the smoke data and two steps of on-policy GRPO on its own rollouts
# (two updates a batch, a lagged sampler, a teacher answer mixed in), by the debug binaries of two commits;
# their metrics.jsonl compared value for value, the timings, throughputs and memory peaks left out. Then
# every shipped config's memory plan and step prediction (`train --plan`), on each model shape of
# configs/models/, three device memories and one or four ranks, compared as text.
#
#   scripts/metrics-equal.sh BEFORE [AFTER]      AFTER: the working tree (default) or a commit
# Builds each commit in a worktree under target/metrics-equal/ into the repository's target folder (the
# dependencies are built once). Prints one line per run and exits 1 when any differs.
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:?usage: scripts/metrics-equal.sh BEFORE [AFTER]}
after=${2:-}
root=$PWD
work=$root/target/metrics-equal
mkdir -p "$work"
export CARGO_TARGET_DIR=$root/target

# The grpo binary of a commit (or of the working tree when the commit is empty), copied to $work/$2.
build() {
    local rev=$1 name=$2 src=$root
    if [ -n "$rev" ]; then
        src=$work/src-$name
        rm -rf "$src"
        git worktree prune
        git worktree add -q --detach "$src" "$rev"
    fi
    (cd "$src" && cargo build -q --bin grpo)
    cp "$CARGO_TARGET_DIR/debug/grpo" "$work/grpo-$name"
    if [ -n "$rev" ]; then git worktree remove --force "$src"; fi
}

# The smoke config with its [objective] table replaced by `name = "$1"` (beta 0.1 where the objective has a
# KL term) and one step; the smoke run itself for "smoke".
config() {
    local objective=$1 out=$2
    if [ "$objective" = smoke ]; then
        sed "s|output_dir = \"runs/smoke\"|output_dir = \"$out\"|" configs/smoke.toml
        return
    fi
    local beta="beta = 0.1"
    case $objective in sft | oapl) beta= ;; esac
    python3 - "$objective" "$beta" "$out" <<'EOF'
import re, sys
name, beta, out = sys.argv[1:]
text = open("configs/smoke.toml").read()
rollout = name == "rollout"
if rollout:
    name, beta = "grpo", 'anchor = "behaviour"\nbeta = 0.1'
table = f'[objective]\nname = "{name}"\n{beta}\n\n'
text = re.sub(r"\[objective\]\n(.*?\n)\n", table, text, count=1, flags=re.S)
steps = "max_steps = 2" if rollout else "max_steps = 1"
text = text.replace('output_dir = "runs/smoke"', f'output_dir = "{out}"').replace("max_steps = 4", steps)
if rollout:
    text += ("\n[rollout]\nteacher_answers = 1\nn = 4\nmax_new_tokens = 8\ntemperature = 1.0\nbatch_size = 8\n"
             "updates_per_batch = 2\nsync_every = 2\nfallbacks = true\n")
print(text)
EOF
}

# metrics.jsonl without the values that depend on the machine or the clock.
numbers() {
    python3 - "$1" <<'EOF'
import json, re, sys
skip = re.compile(r"time|_per_s|per_sec|elapsed|memory|rss|peak|timestamp|wall|eta")
for line in open(sys.argv[1]):
    if line.strip():
        row = json.loads(line)
        print(json.dumps({k: v for k, v in sorted(row.items()) if not skip.search(k)}))
EOF
}

build "$before" before
build "$after" after
status=0
for objective in smoke off_grpo grpo gspo rec cispo opmd asymre red_drop red_weight oapl sft rollout; do
    for side in before after; do
        out=$work/runs/$side/$objective
        rm -rf "$out"
        mkdir -p "$(dirname "$out")"
        config "$objective" "$out" >"$work/$objective-$side.toml"
        GRPO_CACHE_DIR=off "$work/grpo-$side" -q train --config "$work/$objective-$side.toml" >/dev/null
        numbers "$out/metrics.jsonl" >"$work/$objective-$side.metrics"
    done
    if cmp -s "$work/$objective-before.metrics" "$work/$objective-after.metrics"; then
        echo "$objective: equal ($(wc -l <"$work/$objective-after.metrics") steps, $(head -1 "$work/$objective-after.metrics" | python3 -c 'import json, sys; print(len(json.loads(sys.stdin.read())))') values a step)"
    else
        echo "$objective: DIFFERENT"
        diff "$work/$objective-before.metrics" "$work/$objective-after.metrics" | head -6
        status=1
    fi
done
# The plans: the same text from both binaries.
plans=0
differing=0
for c in $(find configs -name '*.toml' ! -path 'configs/devices/*' | sort); do
    for shape in configs/models/*.json; do
        for memory in 80GiB 16GiB 1GiB; do
            for world in 1 4; do
                args=(-q train --config "$c" --plan --model-config "$shape" --device-memory "$memory" --world-size "$world")
                a=$("$work/grpo-before" "${args[@]}" 2>&1 || true)
                b=$("$work/grpo-after" "${args[@]}" 2>&1 || true)
                plans=$((plans + 1))
                if [ "$a" != "$b" ]; then
                    echo "plan of $c on $shape, $memory, $world ranks: DIFFERENT"
                    diff <(echo "$a") <(echo "$b") | head -6
                    differing=$((differing + 1))
                    status=1
                fi
            done
        done
    done
done
echo "plans: $plans compared, $((plans - differing)) equal"
exit "$status"
