#!/usr/bin/env python3
"""Write a synthetic OpenThoughts3-shaped JSONL file of at least SIZE bytes (for `benches/data_stats.sh`).

Rows look like OT3 math rows: {"difficulty": null, "source", "domain", "conversations": [human, gpt]} with a
long <think>...</think> reasoning and a final \\boxed{} answer; 16 answers per question, most agreeing, some
without an answer; the answers of a question are spread over a window of rows (not adjacent), as after a
shuffle. A few malformed lines are mixed in. Deterministic (seeded).

usage: gen_ot3.py OUT.jsonl SIZE_BYTES
"""
import json
import random
import sys

out, size = sys.argv[1], int(float(sys.argv[2]))
rng = random.Random(0)
WORDS = ("we consider the sum of the terms so that each factor divides the product hence by symmetry "
         "the equation reduces to a quadratic whose roots satisfy the given condition therefore").split()


POOL = " ".join(rng.choice(WORDS) for _ in range(400_000))


def text(n_words):
    # A random slice of a pre-generated word pool (about 6 characters per word): fast and varied.
    n = n_words * 6
    start = rng.randrange(0, len(POOL) - n)
    return POOL[start:start + n]


written = 0
q = 0
window = []
with open(out, "w") as f:
    while written < size:
        question = f"Problem {q}: find the value of x such that {text(rng.randint(20, 80))}?"
        gold = rng.randint(0, 1000)
        for k in range(16):
            r = rng.random()
            if r < 0.08:
                tail = "I could not finish."
            elif r < 0.25:
                tail = f"The answer is \\boxed{{{gold + rng.randint(1, 3)}}}."
            else:
                tail = f"The answer is \\boxed{{{gold}}}."
            response = f"<think>\n{text(rng.randint(800, 3000))}\n</think>\n\n{text(60)} {tail}"
            row = {"difficulty": None, "source": "ai2-adapt-dev/openmath-2-math", "domain": "math",
                   "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": response}]}
            window.append(json.dumps(row))
        q += 1
        if len(window) >= 16 * 64:
            rng.shuffle(window)
            for line in window:
                f.write(line + "\n")
                written += len(line) + 1
            if q % 512 == 0:
                f.write('{"conversations": [{"from": "human", "value": "truncated\n')
            window = []
    for line in window:
        f.write(line + "\n")
print(f"wrote {out}: {q} questions")
