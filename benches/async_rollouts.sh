#!/usr/bin/env bash
# Rollouts overlapped with training on the CPU: `mpirun -np 2` with rollout.generation_ranks = 1 (rank 1
# generates with the native engine, rank 0 trains; one thread each), on-policy GRPO on a smoke-sized model
# (2-layer Llama, hidden 64, SmolLM2's 49k-token vocabulary) and the bundled teacher questions, at
# rollout.max_staleness = 0 (each rank waits for the other) and = 1 (step t trains while step t + 1 is
# generated), in the same run. STEPS (10) steps per job, alternating k = 0, k = 1 for ROUNDS (2) rounds;
# a job's steps per second = 1 / the mean step_time of metrics.jsonl after its first step (which at k = 1
# still waits for the first batch), the ratio taken per round and its median printed. Whole-job wall times
# (start-up included) are printed beside them.
#
#   benches/async_rollouts.sh
#   env: BIN (default target/release/grpo, built with --features mpi if missing), STEPS, ROUNDS,
#        MAX_NEW (rollout.max_new_tokens, default 32: generation about as long as training).
# Output: stdout, also saved to benches/results/async-rollouts-cpu-<date>.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/grpo}
STEPS=${STEPS:-10} ROUNDS=${ROUNDS:-2} MAX_NEW=${MAX_NEW:-32}
DATE=$(date +%F)
TXT=benches/results/async-rollouts-cpu-$DATE.txt
[ -x "$BIN" ] || cargo build --release --features mpi --bin grpo -q
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
config() { # $1: output folder, $2: max_staleness
    cat <<TOML
[model]
path = "$WORK/tiny"
init_tiny = { arch = "llama", tokenizer = "data/tokenizers/smollm2", layers = 2, hidden = 64, heads = 4, kv_heads = 2, intermediate = 128, seed = 0 }
dtype = "f32"
device = "cpu"
[data]
inputs = ["data/trajectories/ot3_math_x8_dev.jsonl"]
max_prompt_tokens = 256
max_response_tokens = $MAX_NEW
prepared_dir = "$WORK/prepared"
[objective]
name = "grpo"
anchor = "behaviour"
[optim]
name = "adamw"
lr = 1e-4
[train]
output_dir = "$1"
batch_questions = 2
micro_batch_size = 16
epochs = 0
max_steps = $STEPS
seed = 0
keep_last = 1
save_every = 0
[rollout]
n = 8
max_new_tokens = $MAX_NEW
temperature = 1.0
batch_size = 16
generation_ranks = 1
max_staleness = $2
TOML
}
run() { # $1: name, $2: max_staleness
    config "$WORK/$1" "$2" > "$WORK/$1.toml"
    local t0=$SECONDS
    RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 OMPI_MCA_btl=self,vader,tcp mpirun --allow-run-as-root -np 2 \
        -x RAYON_NUM_THREADS -x OMP_NUM_THREADS "$BIN" -q train --config "$WORK/$1.toml" \
        > "$WORK/$1.log" 2>&1 || { cat "$WORK/$1.log"; exit 1; }
    echo $((SECONDS - t0)) > "$WORK/$1.wall"
}
LOAD0=$(cut -d" " -f1-3 /proc/loadavg)
for r in $(seq "$ROUNDS"); do
    run "k0-$r" 0
    run "k1-$r" 1
done
{
    echo "rollouts overlapped with training: mpirun -np 2 (1 trainer, 1 generation rank, 1 thread each), on-policy GRPO"
    echo "model: 2-layer Llama hidden 64 (SmolLM2 tokenizer), f32, 2 questions x 8 answers of <= $MAX_NEW tokens per step, $STEPS steps"
    echo "date: $DATE"
    echo "device: $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), nproc $(nproc)"
    echo "load average (1/5/15 min) before: $LOAD0, after: $(cut -d" " -f1-3 /proc/loadavg)"
    echo "grpo: $("$BIN" --version) ($BIN)"
    echo "command: benches/async_rollouts.sh (STEPS=$STEPS ROUNDS=$ROUNDS MAX_NEW=$MAX_NEW)"
    python3 - "$WORK" "$ROUNDS" <<'PY'
import json, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
def job(name):
    m = [json.loads(l) for l in open(f"{work}/{name}/metrics.jsonl") if l.strip()]
    after = m[1:]
    mean = lambda k: statistics.mean(s[k] for s in after)
    wall = int(open(f"{work}/{name}.wall").read())
    return dict(sps=1.0 / mean("step_time"), step=mean("step_time"), gen=mean("rollout/generation_time"),
                train=mean("rollout/train_time"), tidle=mean("rollout/trainer_idle"),
                gidle=mean("rollout/generator_idle"), lag=mean("rollout/staleness_mean"),
                dropped=sum(s["rollout/dropped_stale"] for s in m), wall=wall)
print(f"{'job':<6} {'steps/s':>8} {'step s':>7} {'gen s':>7} {'train s':>8} {'trainer idle':>13} {'gen idle':>9} {'lag':>5} {'dropped':>8} {'wall s':>7}")
ratios = []
for r in range(1, rounds + 1):
    j = {k: job(f"k{k}-{r}") for k in (0, 1)}
    for k in (0, 1):
        x = j[k]
        print(f"k={k} r{r} {x['sps']:>8.3f} {x['step']:>7.3f} {x['gen']:>7.3f} {x['train']:>8.3f} {x['tidle']:>13.3f} {x['gidle']:>9.3f} {x['lag']:>5.2f} {x['dropped']:>8} {x['wall']:>7}")
    ratios.append(j[1]["sps"] / j[0]["sps"])
    print(f"round {r}: k=1 / k=0 steps per second = {ratios[-1]:.2f}x; trainer idle at k=1 = {100 * j[1]['tidle'] / j[1]['step']:.1f}% of the step")
print(f"median k=1 / k=0 steps per second: {statistics.median(ratios):.2f}x (goal >= 1.6x)")
PY
} | tee "$TXT"
