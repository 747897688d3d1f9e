#!/usr/bin/env python3
"""The main loop of each attention kernel in nvdisasm's SASS: its instructions, by opcode.

    scripts/gpu/sass_loops.py KERNEL... --sass LABEL=FILE [--sass LABEL=FILE ...]

For each kernel (a function name, e.g. flash_wgmma_fwd_d64_bf16) and each SASS listing, the loop is the
longest backward branch's body (the key or query block loop; its body is one block's step, run once per
block). Prints one row per kernel: the loop's instruction count in each listing, then the multifunction
(MUFU) and tensor-core (HGMMA on sm_90a, HMMA on sm_80) instructions of the last listing. A static count:
the body includes branches a step may skip (the unaligned copies' fallback), the same in every listing.
"""
import argparse
import collections
import re


def loop_body(path, fun):
    lines = open(path).read().split("\n")
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == f".text.{fun}:")
    except StopIteration:
        return None
    body, labels = [], {}
    for line in lines[start + 1:]:
        if line.strip().startswith(".text."):
            break
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(body)
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            body.append(m.group(1).strip())
    loops = []
    for i, ins in enumerate(body):
        m = re.search(r"\bBRA\b.*?(\.L_x_\d+)", ins)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            loops.append((labels[m.group(1)], i))
    if not loops:
        return None
    a, e = max(loops, key=lambda x: x[1] - x[0])
    ops = collections.Counter()
    for ins in body[a:e + 1]:
        words = ins.split()
        op = words[1] if words[0].startswith("@") else words[0]
        ops[op.split(".")[0]] += 1
    return e - a + 1, ops


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernels", nargs="+")
    ap.add_argument("--sass", action="append", required=True, help="LABEL=FILE")
    args = ap.parse_args()
    listings = [s.split("=", 1) for s in args.sass]
    head = " ".join(f"{label:>9s}" for label, _ in listings)
    print(f"{'kernel':34s} {head}   MUFU, tensor-core (last)")
    for k in args.kernels:
        rows = [loop_body(path, k) for _, path in listings]
        if any(r is None for r in rows):
            print(f"{k:34s} (not in every listing)")
            continue
        counts = " ".join(f"{n:9d}" for n, _ in rows)
        ops = rows[-1][1]
        print(f"{k:34s} {counts}   {ops['MUFU']}, {ops['HGMMA'] + ops['HMMA']}")


if __name__ == "__main__":
    main()
