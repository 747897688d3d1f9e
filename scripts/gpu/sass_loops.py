#!/usr/bin/env python3
"""The main loop of each attention kernel in nvdisasm's SASS: its instructions, by opcode.

    scripts/gpu/sass_loops.py KERNEL... --sass LABEL=FILE [--sass LABEL=FILE ...]
                              [--step LABEL=INSIDE,REAL ...]

For each kernel (a function name, e.g. flash_wgmma_fwd_d64_bf16) and each SASS listing, the loop is the
longest backward branch's body (the key or query block loop; its body is one block's step, run once per
block). Prints one row per kernel: the loop's instruction count in each listing, then the multifunction
(MUFU) and tensor-core (HGMMA on sm_90a, HMMA on sm_80) instructions of the last `--sass` listing. A
static count: the body includes branches a step may skip.

`--step LABEL=INSIDE,REAL` adds a column: the instructions a step runs when its rows see every key and
keep their maxima (most steps of a long row), that is the loop of INSIDE (the tree with those tests forced
true, their other branch gone) plus the instructions the tests themselves take in REAL (the same tree
unforced, compiled with -lineinfo and listed by `nvdisasm -g`: the loop's instructions whose source line
is one of TEST_LINES).
"""
import argparse
import collections
import re

# The source lines of the per-step tests that the `inside` variant forces (kernels/flash_rows.cuh and
# flash_wgmma.cu): the row ranges' vote, the dk/dv kernels' per-column test or their stage bounds and its
# vote, the output rescale's vote.
TEST_LINES = [
    "const uint32_t j1 = j0 + KB - 1;",
    "return __all_sync(0xffffffffu, x.lo[0] <= j0",
    "if (rows_see_all<KB>(x, j0))",
    "const QueryStat &x = st[8 * n + 2 * c + q];",
    "inside &= (x.lo <= key0) & (key1 <= x.hi);",
    "bool inside = true;",
    "if (__all_sync(0xffffffffu, inside))",
    "const StageBounds x = bounds[st];",
    "return max(x.lo[0], x.lo[1]) <= key0",
    "if (__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f))",
]


def loop_lines(path, fun):
    """The loop body of `fun` in listing `path`: (instruction, (file, line) or None) each."""
    lines = open(path).read().split("\n")
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == f".text.{fun}:")
    except StopIteration:
        return None
    body, labels, where = [], {}, None
    for line in lines[start + 1:]:
        if line.strip().startswith(".text."):
            break
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = (m.group(1), int(m.group(2)))
            continue
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(body)
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            body.append((m.group(1).strip(), where))
    loops = []
    for i, (ins, _) in enumerate(body):
        m = re.search(r"\bBRA\b.*?(\.L_x_\d+)", ins)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            loops.append((labels[m.group(1)], i))
    if not loops:
        return None
    a, e = max(loops, key=lambda x: x[1] - x[0])
    return body[a:e + 1]


def loop_body(path, fun):
    """The loop's instruction count and its instructions by opcode."""
    body = loop_lines(path, fun)
    if body is None:
        return None
    ops = collections.Counter()
    for ins, _ in body:
        words = ins.split()
        op = words[1] if words[0].startswith("@") else words[0]
        ops[op.split(".")[0]] += 1
    return len(body), ops


def test_instructions(path, fun):
    """The loop's instructions whose source line is one of TEST_LINES (path listed with line info)."""
    body = loop_lines(path, fun)
    if body is None:
        return None
    sources, n = {}, 0
    for _, where in body:
        if where is None:
            continue
        if where[0] not in sources:
            try:
                sources[where[0]] = open(where[0]).read().split("\n")
            except OSError:
                sources[where[0]] = []
        text = sources[where[0]][where[1] - 1] if where[1] <= len(sources[where[0]]) else ""
        n += any(t in text for t in TEST_LINES)
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernels", nargs="+")
    ap.add_argument("--sass", action="append", required=True, help="LABEL=FILE")
    ap.add_argument("--step", action="append", default=[], help="LABEL=INSIDE,REAL")
    args = ap.parse_args()
    listings = [s.split("=", 1) for s in args.sass]
    steps = [(label, files.split(",")) for label, files in (s.split("=", 1) for s in args.step)]
    head = " ".join(f"{label:>9s}" for label, _ in listings + steps)
    print(f"{'kernel':34s} {head}   MUFU, tensor-core (last)")
    for k in args.kernels:
        rows = [loop_body(path, k) for _, path in listings]
        stepped = []
        for _, (inside, real) in steps:
            body, tests = loop_body(inside, k), test_instructions(real, k)
            stepped.append(None if body is None or tests is None else body[0] + tests)
        if any(r is None for r in rows) or any(s is None for s in stepped):
            print(f"{k:34s} (not in every listing)")
            continue
        counts = " ".join(f"{n:9d}" for n in [n for n, _ in rows] + stepped)
        ops = rows[-1][1]
        print(f"{k:34s} {counts}   {ops['MUFU']}, {ops['HGMMA'] + ops['HMMA']}")


if __name__ == "__main__":
    main()
