"""Fit the performance model's host constants to measured GPU train steps, print every point's prediction
beside its measurement and its residual left out of the fit, and write the device and build files the
model reads.

    python3 scripts/calibrate.py [--grpo target/debug/grpo] [--check] [RESULTS.jsonl ...]
    (default: benches/results/gpu-*-h100.jsonl)

For each `grpo bench train-step` line of the results ({"bench": "train_step", "impl": "grpo", ...} on an
H100), the model's prediction of the same step is asked of `grpo bench train-step --predict-only
--measured-build FILE`, FILE the build file whose `tags` hold the results file's tag (gpu-<tag>-h100.jsonl):
the step predicted as its build ran it (its tensor ops, counted on the CPU in that build, its attention
kernels' rates as its run measured them, its offloaded update). It reports, per window of the step (between
host syncs), the device's time, its element-wise part, the tensor ops and kernel launches the host issues,
and the offloaded update's bytes. The step's time is the sum over the windows of the longer of the device's
time and the host's:

    device = other kernels + element-wise * (0.85 / memory_efficiency)
    host   = tensor_ops * launch_s + kernel_launches * kernel_launch_s + pcie_bytes / pcie + host_bytes / B

Three constants are fitted, each with a physical meaning, the rest kept as measured or assumed:
  launch_s            host time per tensor candle makes (bookkeeping, allocation, launch): on the steps
                      without offload, together with
  memory_efficiency   the fraction of HBM bandwidth candle's element-wise kernels reach;
  composite_host_bw   the composite (pre-fused) offloaded AdamW update's bytes per second through host
                      memory, on the offloaded steps of the 2026-11-26 build (fitted there, not checked);
                      this build's fused update runs at the host rate `grpo bench optimizer` measured.
kernel_launch_s (16.8 us, the chunked attention's time per launch at 4,096 tokens in the same run) and
the PCIe bandwidth (50 GB/s, assumed) are not fitted. The fit minimises the squared log of predicted over
measured on a grid (0.25 us, 0.01, 0.25 GB/s).

Leave-one-out: each step the first two constants are fitted on is predicted again from the two refitted on
the other steps; the composite update's one step cannot be left out of its own fit, and the offloaded steps
of the later builds are fitted on by nothing (their residuals are out of the fit already).

It then writes, from the committed GPU results and the fit (every float written as the shortest decimal
that reads back as the same double):
  configs/devices/h100-sxm.toml, a100-80gb.toml   each GPU's rates, with a [sources] table saying where each
                      comes from; the H100's warpgroup attention rates are this build's: the 2026-11-27b
                      run's, projected to this build's leaner loops by the issue model (LEANER, back-tested
                      on the forward's measured gain between the 2026-11-27 and 2026-11-27b builds);
  benches/results/builds/<date>.toml   each build an H100 run measured: its tensor ops, kernels, offloaded
                      update and its warpgroup kernels' rates as that run measured them (tags: its results').

--check: compute everything, write nothing, and exit 1 naming each file whose content is not what this
would write (and when the issue model's back-tests fail). tests/calibration.rs runs it.

GRPO_CALIBRATE_TAGS=1 (temporary): pass each build to --measured-build by its tag, for a binary from before
the build files.
"""
import argparse
import glob
import json
import math
import os
import re
import statistics
import subprocess
import sys
import textwrap
import tomllib
from decimal import Decimal
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PCIE = 50e9
SHAPES = [ROOT / "scripts/gpu/shapes", ROOT / "configs/models"]
RESULTS = ROOT / "benches/results"
BUILDS = RESULTS / "builds"
DEVICES = ROOT / "configs/devices"
COMMAND = "python3 scripts/calibrate.py"

# ---------------------------------------------------------------------------------------------------------
# The attention kernels' measured rates


# A kernel's records: (kernel, atomic_dq, head_dim) of the `"bench": "attention"` records, one layer of 16
# heads of 128 (GQA 4) or 14 heads of 64 (GQA 7, the 0.5B shape's), at 4,096 and 16,384 tokens.
KERNELS = {
    "mma": ("mma", False, 128),
    "wgmma": ("wgmma", False, 128),
    "wgmma_atomic": ("wgmma", True, 128),
    "wgmma_d64": ("wgmma", False, 64),
    "wgmma_atomic_d64": ("wgmma", True, 64),
}
LENGTHS = {"short": 4096, "long": 16384}
WARPGROUP = ["wgmma", "wgmma_atomic", "wgmma_d64", "wgmma_atomic_d64"]
H100_PEAK_TFLOPS = 989.4


@lru_cache(maxsize=None)
def attention_records(tag):
    out = []
    for line in (RESULTS / f"gpu-{tag}-h100.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("bench") == "attention":
            out.append(r)
    return tuple(out)


def measured_rates(tag, name):
    """A kernel's rates as the run of gpu-<tag>-h100.jsonl measured them: its useful TFLOP/s to 0.1, over
    the H100's peak (fractions of it)."""
    kernel, atomic, head_dim = KERNELS[name]

    def at(tokens):
        rs = [r for r in attention_records(tag)
              if (r["kernel"], r["atomic_dq"], r["head_dim"], r["len"]) == (kernel, atomic, head_dim, tokens)]
        if len(rs) != 1:
            sys.exit(f"calibrate: gpu-{tag}-h100.jsonl has {len(rs)} attention records of {name} at {tokens}")
        tflops = [round(rs[0][k] / 1000, 1) for k in ("forward_gflops", "backward_gflops")]
        return {"tokens": tokens, "forward": tflops[0] / H100_PEAK_TFLOPS, "backward": tflops[1] / H100_PEAK_TFLOPS}

    return {k: at(n) for k, n in LENGTHS.items()}


# ---------------------------------------------------------------------------------------------------------
# This build's warpgroup kernels, projected from the 2026-11-27b run's (the issue model)
#
# A kernel's time is taken as a part that issues instructions and a part that does not (its warps stalled
# on latency with no other warp to issue): the first scales with the instructions a step runs, the second
# stays. `issuing`: the 2026-11-27b run's Nsight Compute profile at 16,384 tokens (benches/results/
# gpu-2026-11-27b-h100-ncu.txt, "Issued Warp Per Scheduler"); `before`, `after`: the instructions of an
# inside step of the measured build and of this one (benches/results/sass-loops-2026-11-27b.txt, `step0`
# and `step`: SASS, no GPU). No constant is fitted. The dk/dv kernel with dq by atomics is not profiled:
# the dk/dv kernel's issuing fraction stands for it. dq_share: the dq kernel's share of the two-kernel
# backward's time (the profile's durations: 1.85 of 1.85 + 3.69 ms at head dim 64, 3.35 of 3.35 + 5.26 at 128).

LEANER = {
    64: {"forward": (0.59, 357.0, 304.0), "dq": (0.41, 328.0, 276.0), "dkv": (0.34, 626.0, 457.0),
         "dkvq": (0.34, 818.0, 674.0), "dq_share": 1.85 / 5.54},
    128: {"forward": (0.44, 421.0, 345.0), "dq": (0.42, 398.0, 327.0), "dkv": (0.36, 721.0, 538.0),
          "dkvq": (0.36, 1166.0, 1055.0), "dq_share": 3.35 / 8.61},
}
# The back-test: the forward's change from the 2026-11-27 build to the 2026-11-27b one cut its instructions
# alone, 824 to 357 a step at head dim 64, 962 to 421 at 128 (benches/results/sass-loops-2026-11-27-history.txt).
FORWARD_BEFORE_27B = {64: 824.0, 128: 962.0}


def factor(issue):
    """The time per step after over before (issuing, before, after)."""
    issuing, before, after = issue
    return 1.0 - issuing * (1.0 - after / before)


def projected(rates, head_dim, atomic):
    """A measured kernel's rates at this build's instructions (src/cost/calibration.rs's Leaner, as was)."""
    l = LEANER[head_dim]
    forward = factor(l["forward"])
    if atomic:
        backward = factor(l["dkvq"])
    else:
        backward = l["dq_share"] * factor(l["dq"]) + (1.0 - l["dq_share"]) * factor(l["dkv"])
    return {k: dict(a, forward=a["forward"] / forward, backward=a["backward"] / backward) for k, a in rates.items()}


def this_builds_warpgroup():
    return {name: projected(measured_rates("2026-11-27b", name), KERNELS[name][2], KERNELS[name][1])
            for name in WARPGROUP}


def back_tests():
    """The issue model's checks (src/cost/calibration.rs's tests, as were): lines to print, the failed ones."""
    checks = forward_gain_checks() + projection_checks()
    lines = [("ok      " if ok else "FAILED  ") + text for ok, text in checks]
    return lines, [text for ok, text in checks if not ok]


def forward_gain_checks():
    """The projection back-tested on the forward's change from the 2026-11-27 build to the 27b one (its
    instructions alone), from the later run's issuing fractions, against the two runs' forward rates at 16,384
    tokens: within 3% at head dim 64, the gain overstated by less than 25% at 128."""
    out = []
    for head_dim, name, bound, holds in ((64, "wgmma_d64", "within 3%", lambda p, m: abs(p / m - 1.0) < 0.03),
                                         (128, "wgmma", "overstated by less than 25%", lambda p, m: m < p < 1.25 * m)):
        issuing, instructions_27b, _ = LEANER[head_dim]["forward"]
        projected_gain = factor((issuing, instructions_27b, FORWARD_BEFORE_27B[head_dim]))  # 27's time over 27b's
        measured = (measured_rates("2026-11-27b", name)["long"]["forward"]
                    / measured_rates("2026-11-27", name)["long"]["forward"])
        out.append((holds(projected_gain, measured),
                    f"the forward's gain 2026-11-27 -> 27b at head dim {head_dim}, 16,384 tokens: projected "
                    f"x{projected_gain:.3f}, measured x{measured:.3f} ({bound})"))
    return out


def projection_checks():
    """This build's warpgroup rates are the measured ones over the projected factors: faster, each by no more
    than the share of its time that issues."""
    out, now = [], this_builds_warpgroup()
    for name in WARPGROUP:
        l = LEANER[KERNELS[name][2]]
        then, proj = measured_rates("2026-11-27b", name)["long"], now[name]["long"]
        forward, backward = proj["forward"] / then["forward"], proj["backward"] / then["backward"]
        out.append((1.0 < forward < 1.0 / (1.0 - l["forward"][0]) and
                    then["backward"] < proj["backward"] < then["backward"] / (1.0 - l["dkv"][0]),
                    f"this build's {name} at 16,384 tokens faster than measured, by no more than its issuing "
                    f"share: forward x{forward:.3f}, backward x{backward:.3f}"))
    d64 = measured_rates("2026-11-27b", "wgmma_d64")["long"]["forward"]
    out.append((d64 == 310.3e12 / 989.4e12, "the 2026-11-27b wgmma_d64 forward at 16,384 tokens: 310.3 TFLOP/s "
                                            "over the peak"))
    return out


# ---------------------------------------------------------------------------------------------------------
# The builds the committed H100 runs measured

TENSOR_OPS_FIELDS = ["layer_reference", "layer_policy", "layer_recompute", "layer_backward", "micro_batch",
                     "micro_batch_reference", "step", "accumulate_per_tensor", "accumulate_first_per_tensor",
                     "norm_per_tensor", "update_per_tensor", "seed_passes", "head_grad_bytes", "fused_wgrad",
                     "unnamed_ops_move_bytes"]
# Counted on the CPU in the build the 2026-11-26 H100 run measured: the optimiser's update as composite
# candle ops, the MLP's activation as candle's silu and product, candle-core's backward as released (each
# op's first gradient added to a tensor of zeros).
NOV26_TENSOR_OPS = dict(zip(TENSOR_OPS_FIELDS, [55.0, 55.0, 84.0, 249.0, 186.0, 107.0, 37.0, 2.0, 0.0, 3.0, 15.0,
                                                4.0, 16.0, False, True]))
# The builds the 2026-11-27 runs measured: the q, k and v biases as candle's broadcast add and its sum, v to
# heads a transpose and its copy, every weight's gradient candle's product in the weight's dtype, added by
# kernels::accumulate (its first micro-batch's cast into an accumulator of its own).
NOV27_TENSOR_OPS = dict(zip(TENSOR_OPS_FIELDS, [50.0, 50.0, 65.0, 102.0, 131.0, 75.0, 0.0, 0.8, 1.6, 1.0, 5.0,
                                                0.0, 10.0, False, False]))

BUILD_FILES = {
    "2026-11-26": {
        "about": "The build the H100 run of 2026-11-26 measured, where it differs from this one: the optimiser's "
                 "update as composite candle ops (on the host at composite_host_update_bandwidth, its copies not "
                 "overlapped), the MLP's activation as candle's silu and product, candle-core as released, "
                 "element-wise kernels of one element a thread, each micro-batch's loss read to the host, the first "
                 "warpgroup kernels (no head-dim-64 rates measured: the head-dim-128 ones stand for them).",
        "tags": ["2026-11-26"], "composite_update": True, "tensor_ops": NOV26_TENSOR_OPS,
        "rates": "2026-11-26", "kernels": ["wgmma", "wgmma_atomic"]},
    "2026-11-27": {
        "about": "The build the first H100 run of 2026-11-27 measured (the dk/dv kernels' split groups), where it "
                 "differs from this one: the biases as candle's broadcast add, v to heads a transpose and copy, "
                 "weight gradients in the weight's dtype added by kernels::accumulate, element-wise kernels of one "
                 "element a thread, each micro-batch's loss read to the host, the warpgroup kernels before their "
                 "ring backward.",
        "tags": ["2026-11-27"], "composite_update": False, "tensor_ops": NOV27_TENSOR_OPS,
        "rates": "2026-11-27", "kernels": WARPGROUP},
    "2026-11-27b": {
        "about": "The build the H100 runs of 2026-11-27b and 2026-11-27c measured (the warpgroup backward on the "
                 "forward's ring of slots; 27c: the 7B seed step after the recomputed down projection's fix), where "
                 "it differs from this one: the 2026-11-27 build's tensor ops, element-wise kernels of one element "
                 "a thread, each micro-batch's loss read to the host, the warpgroup kernels before this build's "
                 "leaner loops.",
        "tags": ["2026-11-27b", "2026-11-27c"], "composite_update": False, "tensor_ops": NOV27_TENSOR_OPS,
        "rates": "2026-11-27b", "kernels": WARPGROUP},
}


def build_text(b):
    top = {"tags": b["tags"], "device": "H100 SXM", "packed_kernels": False, "composite_update": b["composite_update"],
           "reads_loss_per_micro_batch": True}
    tables = [("tensor_ops", b["tensor_ops"])]
    tables += [(f"attention.{k}", measured_rates(b["rates"], k)) for k in b["kernels"]]
    header = ["# " + line for line in textwrap.wrap(b["about"], 108)]
    header += [f"# Written by scripts/calibrate.py ({COMMAND}); do not edit by hand. [tensor_ops]: counted on the",
               "# CPU in that build; [attention.*]: the warpgroup kernels' rates as that run measured them (its",
               f"# attention records, benches/results/gpu-{b['rates']}-h100.jsonl; a kernel absent: none measured),",
               "# fractions of the H100's peak in useful FLOPs, in place of the device file's (this build's)."]
    return toml_text(header, top, tables)


def build_file(tag):
    """The file of benches/results/builds/ whose `tags` hold `tag`."""
    for f in sorted(BUILDS.glob("*.toml")):
        if tag in tomllib.loads(f.read_text()).get("tags", []):
            return f
    sys.exit(f"calibrate: no file of {BUILDS} has the tag {tag!r} (the build gpu-{tag}-h100.jsonl measured)")


# ---------------------------------------------------------------------------------------------------------
# The devices

H100_RUN = {"card": "NVIDIA H100 80GB HBM3", "date": "2026-11-26 and 2026-11-27",
            "results": "benches/results/gpu-2026-11-26-h100.jsonl, benches/results/gpu-2026-11-27*-h100*.jsonl"}
FIT_DATA = "the committed H100 train steps (benches/results/gpu-*-h100.jsonl)"


def h100_values(fit):
    """The H100 SXM's values and where each comes from."""
    return {
        "peak_flops": (989.4e12, "datasheet: H100 SXM5 dense BF16 989.4 TFLOP/s (nvidia.com/en-us/data-center/h100)"),
        "multiprocessors": (132, "datasheet: H100 SXM5, 132 SMs"),
        "memory_bandwidth": (3.35e12, "datasheet: H100 SXM5 HBM3 3.35 TB/s"),
        "gemm_efficiency": (0.81, "measured 2026-11-27 (`grpo bench gemm`, benches/results/gpu-2026-11-27-h100-b68f48a.jsonl): "
                                  "one layer's 21 projection GEMMs at the 7B shape over 18,432 rows and the 0.5B over "
                                  "4,096, each timed alone, taken as 25 us plus its FLOPs at this fraction of the peak "
                                  "times its 128 x 128 tiles' utilisation of the 132 SMs"),
        "attention_gemm_efficiency": (0.374, "measured 2026-11-26 (benches/results/gpu-2026-11-26-h100.jsonl): the "
                                             "2048^3 bf16 matmul through candle timed alone, 370 TFLOP/s"),
        "memory_efficiency": (fit["memory_efficiency"], f"fitted by scripts/calibrate.py on the {fit['plain']} steps "
                                                        f"without offload of {FIT_DATA}, with launch_s"),
        "packed_memory_efficiency": (0.80, "assumed: an element-wise kernel moving 16 bytes a thread and access "
                                           "(kernels/common.cuh's packs); a copy kernel of that kind streams "
                                           "2.6-3.0 TB/s of the H100's 3.35"),
        "launch_s": (fit["launch_s"], f"fitted by scripts/calibrate.py on the {fit['plain']} steps without offload "
                                      f"of {FIT_DATA}, with memory_efficiency"),
        "kernel_launch_s": (16.8e-6, "measured 2026-11-26 (benches/results/gpu-2026-11-26-h100.jsonl): the chunked "
                                     "attention's time per launch at 4,096 tokens"),
        "sync_s": (20e-6, "assumed: a host sync (device drained, value copied back, next launch issued) 20 us"),
        "pcie_bandwidth": (50e9, "assumed: PCIe Gen5 x16, ~50 GB/s per direction achieved (not measured)"),
        "host_update_bandwidth": (74.6e9, "measured 2026-11-27 (`grpo bench optimizer` on the H100 machine's host, "
                                          "16 cores, benches/results/gpu-2026-11-27-h100-b68f48a.jsonl): the fused "
                                          "offloaded AdamW update, 256 M bf16 parameters in 0.110 s, 32 B a parameter"),
        "composite_host_update_bandwidth": (fit["composite"], "fitted by scripts/calibrate.py on the offloaded 7B step "
                                                              "of the 2026-11-26 build (benches/results/gpu-2026-11-26-h100.jsonl)"),
        "nvlink_bandwidth": (450e9, "datasheet: NVLink 4, 900 GB/s per GPU, 450 per direction"),
        "network_bandwidth": (50e9, "datasheet: one 400 Gb/s NIC per GPU (DGX H100), 50 GB/s per direction"),
    }


def h100_attention():
    warpgroup = this_builds_warpgroup()
    out = {"mma": (measured_rates("2026-11-27b", "mma"),
                   "measured 2026-11-27b (benches/results/gpu-2026-11-27b-h100.jsonl): one layer, 16 heads of 128, "
                   "GQA 4, at 4,096 and 16,384 tokens; the two-kernel rate stands for dq by atomics")}
    for name in WARPGROUP:
        kernel, atomic, head_dim = KERNELS[name]
        heads = "16 heads of 128, GQA 4" if head_dim == 128 else "14 heads of 64, GQA 7"
        out[name] = (warpgroup[name],
                     f"this build's: the 2026-11-27b run's {'dq by atomics' if atomic else 'two-kernel backward'} "
                     f"({heads}; benches/results/gpu-2026-11-27b-h100.jsonl) projected to this build's leaner loops "
                     f"by scripts/calibrate.py's issue model (benches/results/gpu-2026-11-27b-h100-ncu.txt, "
                     f"benches/results/sass-loops-2026-11-27b.txt)")
    return out


def a100_values(h100):
    """The A100 SXM4 80GB: its datasheet's values, the H100's measured efficiencies where the two cards'
    hardware is alike, assumptions where it is not. No A100 has run grpo."""
    v = {k: (x, f"as the H100's: {s}") for k, (x, s) in h100.items()}
    v.update({
        "peak_flops": (312e12, "datasheet: A100 SXM4 dense BF16 312 TFLOP/s (nvidia.com/en-us/data-center/a100)"),
        "multiprocessors": (108, "datasheet: A100, 108 SMs"),
        "memory_bandwidth": (2.039e12, "datasheet: A100 80GB SXM4 HBM2e 2.039 TB/s"),
        "pcie_bandwidth": (25e9, "assumed: PCIe Gen4 x16, 32 GB/s per direction, ~25 GB/s achieved"),
        "nvlink_bandwidth": (300e9, "datasheet: NVLink 3, 600 GB/s per GPU, 300 per direction"),
        "network_bandwidth": (25e9, "datasheet: one 200 Gb/s HDR NIC per GPU (DGX A100), 25 GB/s per direction"),
    })
    v["gemm_efficiency"] = (h100["gemm_efficiency"][0], "assumed: the H100's measured fraction of the peak (the "
                                                        "A100's lower peak is easier to reach: an underestimate)")
    return v


def device_text(name, values, attention, calibration, about):
    top = {"name": name, **{k: x for k, (x, _) in values.items()}}
    tables = [("calibration", calibration)] if calibration else []
    tables += [(f"attention.{k}", rates) for k, (rates, _) in attention.items()]
    sources = {k: s for k, (_, s) in values.items()}
    sources.update({f"attention.{k}": s for k, (_, s) in attention.items()})
    tables.append(("sources", sources))
    header = ["# " + line for line in about]
    header += [f"# Written by scripts/calibrate.py from the committed GPU results ({COMMAND}); do not edit by hand.",
               "# Rates in B/s, FLOP/s and s; attention rates as fractions of peak_flops in useful FLOPs."]
    return toml_text(header, top, tables)


def device_files(fit):
    h100 = h100_values(fit)
    flat = {"tokens": 1, "forward": 0.35, "backward": 0.35}
    a100_mma = {"mma": ({"short": flat, "long": flat},
                        "assumed: 0.35 of the peak forward and backward at every length (FlashAttention-2 reaches "
                        "50-73% of the A100's peak; these kernels' blocks are smaller); no wgmma on an A100")}
    return {
        DEVICES / "h100-sxm.toml": device_text(
            "H100 SXM", h100, h100_attention(), H100_RUN,
            ["NVIDIA H100 SXM5 80GB: datasheet values, rates measured on the H100 runs of 2026-11-26 and 2026-11-27,",
             "three fitted on their train steps, the rest assumed ([sources] says which); the warpgroup attention",
             "kernels at this build's leaner loops, projected from the 2026-11-27b run's rates."]),
        DEVICES / "a100-80gb.toml": device_text(
            "A100 80GB", a100_values(h100), a100_mma, None,
            ["NVIDIA A100 SXM4 80GB: no A100 has run grpo. Its datasheet's values; the H100's measured",
             "efficiencies where the two cards' hardware is alike; assumptions where it is not ([sources])."]),
    }


# ---------------------------------------------------------------------------------------------------------
# TOML, written so that each float reads back as the same double


def toml_float(x):
    s = repr(x)
    if abs(x) >= 1e6 or 0 < abs(x) < 1e-3:
        s = f"{Decimal(s).normalize():e}".replace("e+", "e")
    assert float(s) == x, (x, s)
    return s


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return toml_float(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(map(toml_value, v)) + "]"
    return "{ " + ", ".join(f"{toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + " }"


def toml_key(k):
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def toml_text(header, top, tables):
    lines = header + [f"{toml_key(k)} = {toml_value(v)}" for k, v in top.items()]
    for name, kvs in tables:
        lines += ["", f"[{name}]"] + [f"{toml_key(k)} = {toml_value(v)}" for k, v in kvs.items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------
# The fit


def shape_path(name):
    for d in SHAPES:
        p = d / f"{name}.json"
        if p.exists():
            return p
    sys.exit(f"calibrate: no shape file for {name!r} in {[str(d) for d in SHAPES]}")


def bench_args(r, tag):
    """The `grpo bench train-step` arguments of a measured line of gpu-<tag>-h100.jsonl."""
    args = ["--shape", str(shape_path(r["shape"])), "--answers", str(r["answers"]), "--seq-len", str(r["seq_len"]),
            "--prompt-len", str(r["prompt_len"]), "--micro-batch", str(r["micro_batch"]),
            "--logprob-chunk-mb", str(r["logprob_chunk_mb"]), "--dtype", r["dtype"], "--attention", r["attention"]]
    for flag, key in (("--checkpoint-layers", "checkpoint_layers"), ("--keep-attention", "keep_attention"),
                      ("--atomic-dq", "atomic_dq"), ("--offload", "offload")):
        if r.get(key):
            args.append(flag)
    if not r.get("reference", True):
        args.append("--no-reference")
    if not r.get("fused_ops", True):
        args.append("--composite-ops")
    # Each step is predicted as its build ran it (its file of benches/results/builds/, found by the tag of
    # its results file): its tensor ops, attention kernels' rates and offloaded update.
    build = tag if os.environ.get("GRPO_CALIBRATE_TAGS") == "1" else str(build_file(tag))
    return args + ["--measured-build", build]


def file_tag(path):
    """The tag of benches/results/gpu-<tag>-h100.jsonl (the build that run measured)."""
    name = Path(path).name
    if not (name.startswith("gpu-") and name.endswith("-h100.jsonl")):
        sys.exit(f"calibrate: {name}: not a gpu-<tag>-h100.jsonl file, so its build is unknown")
    return name[len("gpu-"):-len("-h100.jsonl")]


def windows(grpo, r, tag):
    cmd = [grpo, "bench", "train-step", "--predict-only", *bench_args(r, tag)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"calibrate: {' '.join(cmd)}: exit {run.returncode}\n{run.stderr.strip()}")
    pred = json.loads(run.stdout)["predicted"]
    h100 = next(p for p in pred if p["gpu"].startswith("H100"))
    # The rates the device's times were computed at: the fit rescales the element-wise part.
    for w in h100["windows"]:
        w["at_efficiency"], w["kernel_launch_s"] = h100["memory_efficiency"], h100["kernel_launch_s"]
    return h100["windows"]


def predict(ws, launch_s, efficiency, host_bw):
    """host_bw None: the offloaded update at the model's own (measured) host rate."""
    total = 0.0
    for w in ws:
        device = w["device_s"] + w["elementwise_s"] * (w["at_efficiency"] / efficiency - 1.0)
        update = w["host_update_s"] if host_bw is None else w["host_bytes"] / host_bw
        serial = w["serial_pcie_bytes"]
        offload = serial / PCIE + max(update, (w["pcie_bytes"] - serial) / PCIE)
        host = w["launches"] * launch_s + w["kernel_launches"] * w["kernel_launch_s"] + offload
        total += max(device, host)
    return total


def loss(points, **k):
    return sum(math.log(predict(p["windows"], **k) / p["measured"]) ** 2 for p in points)


def host_grid(points):
    """Each (launch_us, efficiency) of the grid with its squared log residual at each step without offload."""
    cells = []
    for launch_us in [x / 4 for x in range(4, 161)]:
        for eff in [x / 100 for x in range(20, 96)]:
            errs = [math.log(predict(p["windows"], launch_us * 1e-6, eff, 1e12) / p["measured"]) ** 2 for p in points]
            cells.append(((launch_us, eff), errs))
    return cells


def fit_host(grid, keep=None):
    """launch_s and memory_efficiency on the steps `keep` selects (all: None): the grid's least loss, the
    launch time written from its decimal (8.5 us: 8.5e-6, the nearest double)."""
    best = None
    for cell, errs in grid:
        e = sum(x for i, x in enumerate(errs) if keep is None or keep(i))
        if best is None or e < best[0]:
            best = (e, cell)
    launch_us, eff = best[1]
    return float(f"{launch_us}e-6"), eff


def fit_update(points, launch_s, eff):
    """The composite host update's rate on the offloaded steps of that build."""
    best = None
    for gbps in [x / 4 for x in range(4, 801)]:
        e = loss(points, launch_s=launch_s, efficiency=eff, host_bw=gbps * 1e9)
        if best is None or e < best[0]:
            best = (e, gbps)
    return float(f"{best[1]}e9")


def describe(r):
    opts = [r["attention"]] + [k for k in ("checkpoint_layers", "keep_attention", "atomic_dq", "offload") if r.get(k)]
    if not r.get("reference", True):
        opts.append("no reference")
    return f"{r['shape']} {r['answers']}x{r['seq_len']} mb{r['micro_batch']} {'+'.join(opts)}"


def load_points(grpo, files):
    points = []
    for f in files:
        for line in Path(f).read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("bench") == "train_step" and r.get("impl") == "grpo" and "H100" in r.get("device", ""):
                points.append({"record": r, "measured": r["step_time_s"], "windows": windows(grpo, r, file_tag(f)),
                               "file": Path(f).name})
    if not points:
        sys.exit("calibrate: no H100 train steps of grpo in " + ", ".join(map(str, files)))
    return points


def role(p, composite):
    return ("composite_host_update_bandwidth" if p in composite else
            "not fitted on" if p["record"].get("offload") else "launch_s, memory_efficiency")


def print_fit(points, plain, composite, launch_s, eff, host_bw):
    print(f"fitted on {len(plain)} steps without offload: launch_s = {launch_s * 1e6:.2f} us, "
          f"memory_efficiency = {eff:.2f}")
    print(f"fitted on {len(composite)} offloaded steps of the composite update: composite_host_update_bandwidth "
          f"= {host_bw / 1e9:.2f} GB/s" + ("" if composite else " (none measured: default)"))
    k = points[0]["windows"][0]["kernel_launch_s"]
    print(f"measured, not fitted: kernel_launch_s = {k * 1e6:.1f} us; assumed: PCIe {PCIE / 1e9:.0f} GB/s\n")
    print(f"{'step':<70} {'measured s':>10} {'predicted s':>11} {'pred/meas':>9}  fitted on")
    worst = 0.0
    for p in points:
        pred = predict(p["windows"], launch_s, eff, host_bw if p in composite else None)
        ratio = pred / p["measured"]
        worst = max(worst, abs(math.log(ratio)))
        print(f"{describe(p['record']):<70} {p['measured']:>10.3f} {pred:>11.3f} {ratio:>9.3f}  {role(p, composite)}")
    print(f"\nworst residual: x{math.exp(worst):.3f}")


def summary(ratios):
    logs = [abs(math.log(r)) for r in ratios]
    return f"worst x{math.exp(max(logs)):.3f}, median x{math.exp(statistics.median(logs)):.3f}"


def print_leave_one_out(points, plain, composite, grid, launch_s, eff):
    """Each step without offload predicted from launch_s and memory_efficiency refitted on the others."""
    print(f"\nleave-one-out: each of the {len(plain)} steps without offload predicted from launch_s and "
          f"memory_efficiency refitted on the other {len(plain) - 1}")
    print(f"{'step':<70} {'measured s':>10} {'predicted s':>11} {'pred/meas':>9}  refitted launch_s, efficiency")
    held = []
    for i, p in enumerate(plain):
        l, e = fit_host(grid, keep=lambda j: j != i)
        pred = predict(p["windows"], l, e, None)
        held.append(pred / p["measured"])
        print(f"{describe(p['record']):<70} {p['measured']:>10.3f} {pred:>11.3f} {held[-1]:>9.3f}  "
              f"{l * 1e6:.2f} us, {e:.2f}")
    never = [p for p in points if p not in plain and p not in composite]
    print(f"\nheld out, {len(plain)} steps left out in turn: {summary(held)}")
    for p in never:
        ratio = predict(p["windows"], launch_s, eff, None) / p["measured"]
        held.append(ratio)
        print(f"held out, never fitted on: {describe(p['record'])} ({p['file']}): x{ratio:.3f} of its time")
    if never:
        print(f"held out, all {len(held)} (with the {len(never)} never fitted on): {summary(held)}")
    if composite:
        steps = "one step (composite_host_update_bandwidth is fitted on it" if len(composite) == 1 else \
            f"{len(composite)} steps (composite_host_update_bandwidth is fitted on them"
        print(f"not held out: the composite update's {steps} alone)")


def write_or_check(texts, check):
    """The files of `texts` whose content differs (check), or written."""
    differ = []
    for path, text in texts.items():
        shown = path.relative_to(ROOT)
        same = path.exists() and path.read_text() == text
        if check:
            print(f"{'up to date' if same else 'DIFFERS'}: {shown}")
            if not same:
                differ.append(str(shown))
        elif not same:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {shown}")
        else:
            print(f"unchanged: {shown}")
    return differ


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grpo", default=str(ROOT / "target/debug/grpo"))
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a written file would differ")
    ap.add_argument("results", nargs="*")
    a = ap.parse_args()
    files = a.results or sorted(glob.glob(str(RESULTS / "gpu-*-h100.jsonl")))
    if os.environ.get("GRPO_CALIBRATE_TAGS") == "1":
        print("GRPO_CALIBRATE_TAGS=1: each step's build passed to --measured-build by its tag\n")
    # The build files first: the predictions read them.
    differ = write_or_check({BUILDS / f"{n}.toml": build_text(b) for n, b in BUILD_FILES.items()}, a.check)
    print()
    points = load_points(a.grpo, files)
    plain = [p for p in points if not p["record"].get("offload")]
    # Offloaded steps of the build the 2026-11-26 run measured (the composite host update, whose rate is
    # fitted); the later builds' fused update runs at the rate `grpo bench optimizer` measured.
    composite = [p for p in points if p["record"].get("offload") and p["record"].get("update") != "fused"]
    grid = host_grid(plain)
    launch_s, eff = fit_host(grid)
    host_bw = fit_update(composite, launch_s, eff) if composite else 1e11
    print_fit(points, plain, composite, launch_s, eff, host_bw)
    print_leave_one_out(points, plain, composite, grid, launch_s, eff)
    lines, failed = back_tests()
    print("\nthe issue model's projection of this build's warpgroup kernels (LEANER), back-tested:")
    print("\n".join("  " + line for line in lines))
    print()
    fit = {"launch_s": launch_s, "memory_efficiency": eff, "composite": host_bw, "plain": len(plain)}
    differ += write_or_check(device_files(fit), a.check)
    if differ:
        sys.exit("calibrate --check: not what scripts/calibrate.py writes (run it to rewrite them): " + ", ".join(differ))
    if failed:
        sys.exit("calibrate: the issue model's back-tests failed: " + "; ".join(failed))


if __name__ == "__main__":
    main()
