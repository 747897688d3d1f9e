#!/usr/bin/env python3
"""Helpers of benches/learning.sh (standard library only).

split OUT_DIR: split the bundled 50-question dev trajectories (data/trajectories/ot3_math_x8_dev.jsonl,
  8 answers a question) into the questions trained on and the held-out questions no arm trains on.
  Writes OUT_DIR/train.jsonl (OT3 rows, the trainer's input) and OUT_DIR/heldout.jsonl ({"prompt",
  "response", "question", "majority"} rows, the input of `grpo logprobs`; each response cut to its first
  HELDOUT_CHARS characters, about as many tokens as training keeps, to bound the scoring's cost on 2 CPU
  cores). An answer's vote is the last \\boxed{...} of the whole answer; the majority answers are those
  with the most common one.
measure SCORED STEP OUT: from `grpo logprobs`'s output SCORED on heldout.jsonl, append one line
  {"step", "heldout/margin", "heldout/majority_logprob", ...} to OUT (a per-step metrics JSONL that
  `grpo plot --metrics-file` reads). Per answer the mean log-prob per response token; the margin is,
  per question, the mean over its majority answers minus the mean over its minority answers, averaged
  over the questions.
report OUT_DIR: the table of before/after per arm and seed, the change's spread between seeds.
"""
import json
import os
import sys
from collections import Counter

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "trajectories", "ot3_math_x8_dev.jsonl")
GROUP = 8
# Held out: three of the six questions whose answers disagree without a tie (their margin is defined),
# the shortest ones (scoring cost). No arm trains on them.
HELDOUT = [35, 36, 49]
# Trained on: two of the other disagreeing questions (the only groups with a nonzero advantage when b = 0)
# and two unanimous ones of typical length; the same questions in every arm and seed.
TRAIN = [3, 46, 0, 1]
HELDOUT_CHARS = 300


def last_boxed(text):
    """The content of the last \\boxed{...} of `text` (braces matched), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def groups():
    with open(DATA) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if len(rows) % GROUP:
        sys.exit(f"{DATA}: {len(rows)} rows, not groups of {GROUP}")
    return [rows[i : i + GROUP] for i in range(0, len(rows), GROUP)]


def split(out_dir):
    qs = groups()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "train.jsonl"), "w") as f:
        for q in TRAIN:
            for row in qs[q]:
                f.write(json.dumps(row) + "\n")
    items = []
    for q in HELDOUT:
        prompt = qs[q][0]["conversations"][0]["value"]
        answers = [r["conversations"][1]["value"] for r in qs[q]]
        votes = [last_boxed(a) for a in answers]
        (top, n), *rest = Counter(v for v in votes if v is not None).most_common()
        if rest and rest[0][1] == n:
            sys.exit(f"held-out question {q}: tied vote")
        for a, v in zip(answers, votes):
            items.append({"question": q, "majority": v == top, "prompt": prompt, "response": a[:HELDOUT_CHARS]})
    # Similar lengths together: `grpo logprobs` pads each batch to its longest line.
    items.sort(key=lambda x: len(x["response"]))
    with open(os.path.join(out_dir, "heldout.jsonl"), "w") as f:
        for it in items:
            f.write(json.dumps(it) + "\n")
    print(f"train: questions {TRAIN}; held out: questions {HELDOUT}, {len(items)} answers")


def measure(scored, step, out):
    per_q = {}
    with open(scored) as f:
        for line in f:
            r = json.loads(line)
            mean = sum(r["logprobs"]) / len(r["logprobs"])
            per_q.setdefault(r["question"], {True: [], False: []})[r["majority"]].append(mean)
    avg = lambda xs: sum(xs) / len(xs)
    margins = [avg(v[True]) - avg(v[False]) for v in per_q.values() if v[True] and v[False]]
    record = {
        "step": int(step),
        "heldout/margin": avg(margins),
        "heldout/majority_logprob": avg([x for v in per_q.values() for x in v[True]]),
        "heldout/minority_logprob": avg([x for v in per_q.values() for x in v[False]]),
        "heldout/questions": len(margins),
    }
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record))


def accuracy(path):
    """Greedy accuracy of a `grpo eval` generations file / validation record (mean fraction correct)."""
    with open(path) as f:
        probs = [json.loads(line)["samples"] for line in f if line.strip()]
    return sum(sum(s["correct"] is True for s in ss) / len(ss) for ss in probs) / len(probs), len(probs)


def run_row(run):
    """(first and last held-out lines, accuracy before and after, last step) of a run folder, or None."""
    path = os.path.join(run, "heldout.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    vdir = os.path.join(run, "validation")
    records = sorted(n for n in os.listdir(vdir) if n.startswith("step-")) if os.path.isdir(vdir) else []
    if not records:
        return lines[0], lines[-1], None, None
    acc = [accuracy(os.path.join(vdir, n)) for n in (records[0], records[-1])]
    return lines[0], lines[-1], acc, int(records[-1].split("-")[1])


def report(out_dir):
    keys = [("heldout/margin", "margin"), ("heldout/majority_logprob", "majority lp")]
    seeds = sorted(d for d in os.listdir(out_dir) if d.startswith("seed"))
    arms = ["sft", "off_policy", "off_policy_bias", "on_policy"]
    print("arm              seed   " + "".join(f"{t:>28}" for _, t in keys) + "   greedy acc (n)")
    changes = {}
    for arm in arms:
        for seed in seeds:
            row = run_row(os.path.join(out_dir, seed, arm))
            if row is None:
                continue
            first, last, acc, vstep = row
            cells = ""
            for k, _ in keys:
                d = last[k] - first[k]
                changes.setdefault((arm, k), []).append(d)
                cells += f"  {first[k]:+.4f} -> {last[k]:+.4f} ({d:+.4f})"
            if acc is None:
                print(f"{arm:<16} {seed:<6} {cells}   not measured (step {last['step']})")
                continue
            (a0, n), (a1, _) = acc
            print(f"{arm:<16} {seed:<6} {cells}   {a0:.2f} -> {a1:.2f} (n={n}, step {last['step']}/{vstep})")
    print("\nchange from step 0 to the last step: mean over seeds, and the spread (max - min) between seeds")
    for (arm, k), ds in changes.items():
        spread = f"spread {max(ds) - min(ds):.4f}" if len(ds) > 1 else "one seed"
        print(f"  {arm:<16} {k:<26} mean {sum(ds) / len(ds):+.4f}  {spread}  ({len(ds)} seeds)")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "split":
        split(sys.argv[2])
    elif len(sys.argv) == 5 and sys.argv[1] == "measure":
        measure(*sys.argv[2:])
    elif len(sys.argv) == 3 and sys.argv[1] == "report":
        report(sys.argv[2])
    else:
        sys.exit(__doc__)
