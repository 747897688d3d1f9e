#!/usr/bin/env python3
"""The warpgroup attention kernels' rates as issue-bound steps: a projection from SASS instruction counts.

    scripts/attention-issue-model.py [SASS_LOOPS] [MEASURED_JSONL]

SASS_LOOPS: scripts/gpu/sass-loops.sh's output (default benches/results/sass-loops-2026-11-27.txt: each
kernel's main-loop instructions per block step, `before` = the build the H100 measured, `inside` = this
tree's step that needs no mask). MEASURED_JSONL: that build's `bench attention` records (default
benches/results/gpu-2026-11-27-h100.jsonl: the two-kernel warpgroup backward at 16,384 tokens, head dims 64
and 128).

A pair of block steps (one per warpgroup: 64 x 64 scores each) on a multiprocessor takes its products'
cycles at the tensor cores' peak plus k cycles per instruction each of its four schedulers issues (two
warps each: 2 x the loop's instructions, less the 44 of the unaligned copies' fallback that no aligned step
runs):

    cycles = products' FLOPs / (peak / multiprocessors / clock) + k * 2 * instructions

k is fitted once for the forward (its warpgroups take turns, so one's softmax overlaps the other's
products) and once for the backward (the dq kernel, 3 products a step, then the dk/dv kernel, 4; both
warpgroups in the same phase, a barrier a step), each on head dims 64 and 128: two constants, four
measurements. A k that agrees across the head dims says the steps were issue-bound. The dq-by-atomics
backward (its dk/dv kernel alone, 5 products a step) is predicted from the backward's k and checked against
its own measurement, which the fit never saw. Then the same k give this tree's rates from its counts: a
projection, not a measurement; the next GPU run's `bench attention` lines are what count. In this tree the
dq and dk/dv kernels run the forward's schedule (a ring of slots published by halves, the warpgroups taking
turns, no block-wide barrier a step): their steps are projected with the forward's k, but the atomic dk/dv
kernel at head dim 128 (two stages, a barrier a step), projected with the backward's. The sum counts no
second block on a multiprocessor (the forward at 64).
"""
import json
import sys

PEAK, SMS, CLOCK = 989.4e12, 132, 1.83e9  # H100 SXM dense bf16 peak at its 1.83 GHz boost: 4,096 FLOP/cycle/SM
FLOP_PER_CYCLE = PEAK / SMS / CLOCK
FALLBACK = 44  # the unaligned copies' loads and stores in every loop (STS 18, LDG 16, LDS 10): not run


def counts(path):
    out = {}
    for line in open(path):
        w = line.split()
        if len(w) >= 4 and w[0].startswith("flash_wgmma_") and w[0].endswith("_bf16"):
            out[w[0][len("flash_wgmma_"):-len("_bf16")]] = {"before": int(w[1]), "inside": int(w[3])}
    return out


def measured(path, tokens=16384):
    out = {}
    for line in open(path):
        r = json.loads(line)
        if r.get("bench") == "attention" and r.get("kernel") == "wgmma" and r.get("len") == tokens:
            out[(r["head_dim"], r["atomic_dq"])] = (r["forward_gflops"] / 1e3, r["backward_gflops"] / 1e3)
    return out


def products(d, n):
    """FLOPs of n 64 x 64 x d products in each of two warpgroups."""
    return 2 * n * 64 * 64 * d * 2


def rate(useful, tensor, issue, k):
    """Useful TFLOP/s of a step pair whose products take `tensor` FLOPs and whose schedulers issue `issue`."""
    cycles = tensor / FLOP_PER_CYCLE + k * issue
    return useful / FLOP_PER_CYCLE / cycles * PEAK / 1e12


def issue(c, which, *kernels):
    return sum(2 * (c[k][which] - FALLBACK) for k in kernels)


# This tree's kernels on the forward's schedule (the rest keep a barrier a step).
RING = {"fwd_d64", "fwd_d128", "bwd_dq_d64", "bwd_dq_d128", "bwd_dkv_d64", "bwd_dkv_d128", "bwd_dkvq_d64"}


def fit_k(useful, tensor, issued, tflops):
    cycles = useful / FLOP_PER_CYCLE / (tflops * 1e12 / PEAK)
    return (cycles - tensor / FLOP_PER_CYCLE) / issued


def main():
    sass = sys.argv[1] if len(sys.argv) > 1 else "benches/results/sass-loops-2026-11-27.txt"
    runs = sys.argv[2] if len(sys.argv) > 2 else "benches/results/gpu-2026-11-27-h100.jsonl"
    c, m = counts(sass), measured(runs)
    # (kind, useful products a step pair, products run, kernels) per head dim
    kinds = {
        "forward": (2, 2, ("fwd_d{d}",)),
        "backward": (5, 7, ("bwd_dq_d{d}", "bwd_dkv_d{d}")),
        "backward, dq by atomics": (5, 5, ("bwd_dkvq_d{d}",)),
    }

    def parts(kind, d, which):
        useful, run, ks = kinds[kind]
        return products(d, useful), products(d, run), issue(c, which, *[k.format(d=d) for k in ks])

    def projected(kind, d):
        """This tree's rate: each kernel's instructions at the k of its schedule."""
        useful, run, ks = kinds[kind]
        names = [name.format(d=d) for name in ks]
        weighted = sum(issue(c, "inside", n) * (k["forward"] if n in RING else k["backward"]) for n in names)
        return rate(products(d, useful), products(d, run), weighted, 1.0)

    def seen(kind, d):
        return m[(d, kind.endswith("atomics"))][0 if kind == "forward" else 1]

    k = {}
    print(f"# {__doc__.splitlines()[0]}\n# counts: {sass}; measured: {runs} (16,384 tokens)")
    for kind in ("forward", "backward"):
        fits = [fit_k(*parts(kind, d, "before"), seen(kind, d)) for d in (64, 128)]
        k[kind] = sum(fits) / 2
        print(f"k {kind}: {fits[0]:.2f} (head dim 64), {fits[1]:.2f} (128): {k[kind]:.2f} cycles per instruction")
    k["backward, dq by atomics"] = k["backward"]
    print(f"{'kernel':26s} {'head dim':>8s} {'measured':>9s} {'fitted':>7s} {'this tree':>10s}  TFLOP/s (useful)")
    for kind in kinds:
        for d in (64, 128):
            before = rate(*parts(kind, d, "before"), k[kind])
            after = projected(kind, d)
            note = "" if kind in ("forward", "backward") else "  (not fitted on)"
            print(f"{kind:26s} {d:8d} {seen(kind, d):9.1f} {before:7.1f} {after:10.1f}{note}")


if __name__ == "__main__":
    main()
