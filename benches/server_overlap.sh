#!/usr/bin/env bash
# A rollout server kept busy while the trainer trains: on-policy GRPO with `[rollout.server]` against a
# fake OpenAI-compatible server (Python's standard library) that answers each request after DELAY (0.2)
# seconds and reloads instantly (SGLang's /update_weights_from_disk), at rollout.max_staleness = 0
# (generate, then train) and = 1 (the next step's requests in flight while a step trains), in the same
# run. Smoke-sized model (2-layer Llama, hidden 64, SmolLM2's vocabulary, f32 on the CPU), 2 questions x 8
# answers per step, STEPS (8) steps per job, ROUNDS (2) rounds alternating k = 0, k = 1. Printed per job:
# the mean step time, training time and trainer idle time (waiting for answers) of metrics.jsonl after the
# first step, and the idle time as a share of the step (goal at k = 1: <= 10%). At k = 0 (no overlap
# metrics) the idle time is the whole generation (rollout/generation_time).
#
#   benches/server_overlap.sh
#   env: BIN (default target/release/grpo, built if missing), DELAY, STEPS, ROUNDS.
# Output: stdout, also saved to benches/results/server-overlap-cpu-<date>.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/grpo}
DELAY=${DELAY:-0.2} STEPS=${STEPS:-8} ROUNDS=${ROUNDS:-2}
DATE=$(date +%F)
TXT=benches/results/server-overlap-cpu-$DATE.txt
[ -x "$BIN" ] || cargo build --release --bin grpo -q
WORK=$(mktemp -d)
cat > "$WORK/server.py" <<'PY'
import http.server, json, sys, time, zlib
delay = float(sys.argv[1])
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path.endswith("/completions"):
            time.sleep(delay)
            h = zlib.crc32(body["prompt"].encode())
            texts = ["The answer is \\boxed{7}.", "It is \\boxed{3}.", "So \\boxed{12}."]
            out = {"choices": [{"index": i, "text": texts[(h + i) % 3], "finish_reason": "stop"} for i in range(body["n"])]}
        else:
            out = {"success": True}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def log_message(self, *a):
        pass
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
PY
python3 "$WORK/server.py" "$DELAY" > "$WORK/port" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; rm -rf "$WORK"' EXIT
for _ in $(seq 50); do [ -s "$WORK/port" ] && break; sleep 0.1; done
PORT=$(head -1 "$WORK/port")
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
max_response_tokens = 64
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
max_new_tokens = 64
reload = "sglang"
max_staleness = $2
[rollout.server]
engine = "openai"
served_model = "m"
base_url = "http://127.0.0.1:$PORT/v1"
TOML
}
LOAD0=$(cut -d" " -f1-3 /proc/loadavg)
for r in $(seq "$ROUNDS"); do
    for k in 0 1; do
        config "$WORK/k$k-$r" "$k" > "$WORK/k$k-$r.toml"
        "$BIN" -q train --config "$WORK/k$k-$r.toml" > "$WORK/k$k-$r.log" 2>&1 || { cat "$WORK/k$k-$r.log"; exit 1; }
    done
done
{
    echo "a rollout server kept busy: on-policy GRPO, fake OpenAI server answering each request after $DELAY s"
    echo "model: 2-layer Llama hidden 64 (SmolLM2 tokenizer), f32, 2 questions x 8 answers per step, $STEPS steps"
    echo "date: $DATE"
    echo "device: $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), nproc $(nproc)"
    echo "load average (1/5/15 min) before: $LOAD0, after: $(cut -d" " -f1-3 /proc/loadavg)"
    echo "grpo: $("$BIN" --version) ($BIN)"
    echo "command: benches/server_overlap.sh (DELAY=$DELAY STEPS=$STEPS ROUNDS=$ROUNDS)"
    python3 - "$WORK" "$ROUNDS" <<'PY'
import json, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
print(f"{'job':<7} {'step s':>7} {'train s':>8} {'sync s':>7} {'trainer idle s':>15} {'idle/step':>10} {'lag':>5}")
worst = 0.0
for r in range(1, rounds + 1):
    for k in (0, 1):
        m = [json.loads(l) for l in open(f"{work}/k{k}-{r}/metrics.jsonl") if l.strip()][1:]
        # k = 0 has no overlap metrics: the trainer waits for the whole generation (server, scoring and the
        # behaviour forward: rollout/generation_time) and trains the rest of the step.
        get = lambda s, key: s[key] if key in s else {
            "rollout/trainer_idle": s["rollout/generation_time"],
            "rollout/train_time": s["step_time"] - s["rollout/generation_time"],
            "rollout/weight_sync_time": float("nan"), "rollout/staleness_mean": 0.0}[key]
        mean = lambda key: statistics.mean(get(s, key) for s in m)
        step, idle = mean("step_time"), mean("rollout/trainer_idle")
        print(f"k={k} r{r} {step:>7.3f} {mean('rollout/train_time'):>8.3f} {mean('rollout/weight_sync_time'):>7.3f} {idle:>15.3f} {100 * idle / step:>9.1f}% {mean('rollout/staleness_mean'):>5.2f}")
        if k == 1:
            worst = max(worst, idle / step)
print(f"trainer idle at k=1: at most {100 * worst:.1f}% of the step (goal <= 10%)")
PY
} | tee "$TXT"
