"""Fit the performance model's host constants to measured GPU train steps, and print every point's
prediction beside its measurement.

    python3 scripts/calibrate.py [--grpo target/debug/grpo] [RESULTS.jsonl ...]
    (default: benches/results/gpu-*-h100.jsonl)

For each `grpo bench train-step` line of the results ({"bench": "train_step", "impl": "grpo", ...} on an
H100), the model's prediction of the same step is asked of `grpo bench train-step --predict-only` (the
model of src/cost/time.rs with the H100's measured rates: GEMM efficiency and attention kernels from the
same run, the tensor ops of each part of a step counted on the CPU). It reports, per window of the step
(between host syncs), the device's time, its element-wise part, the tensor ops and kernel launches the
host issues, and the offloaded update's bytes. The step's time is the sum over the windows of the longer
of the device's time and the host's:

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
measured; src/cost/calibration.rs holds the result and a test holds every point within 25%.
"""
import argparse
import glob
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PCIE = 50e9
SHAPES = [ROOT / "scripts/gpu/shapes", ROOT / "configs/models"]


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
    # Each step is predicted as its build ran it (src/cost/calibration.rs's MeasuredBuild, named by the tag of
    # its results file): its tensor ops, attention kernels' rates and offloaded update.
    return args + ["--measured-build", tag]


def file_tag(path):
    """The tag of benches/results/gpu-<tag>-h100.jsonl (the build that run measured)."""
    name = Path(path).name
    if not (name.startswith("gpu-") and name.endswith("-h100.jsonl")):
        sys.exit(f"calibrate: {name}: not a gpu-<tag>-h100.jsonl file, so its build is unknown")
    return name[len("gpu-"):-len("-h100.jsonl")]


def windows(grpo, r, tag):
    out = subprocess.run([grpo, "bench", "train-step", "--predict-only", *bench_args(r, tag)], check=True,
                         capture_output=True, text=True).stdout
    pred = json.loads(out)["predicted"]
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


def fit_host(points):
    """launch_s and memory_efficiency on the steps without offload: a grid, then a finer one around it."""
    best = None
    for launch_us in [x / 4 for x in range(4, 161)]:
        for eff in [x / 100 for x in range(20, 96)]:
            e = loss(points, launch_s=launch_us * 1e-6, efficiency=eff, host_bw=1e12)
            if best is None or e < best[0]:
                best = (e, launch_us * 1e-6, eff)
    return best[1], best[2]


def fit_update(points, launch_s, eff):
    """The composite host update's rate on the offloaded steps of that build."""
    best = None
    for gbps in [x / 4 for x in range(4, 801)]:
        e = loss(points, launch_s=launch_s, efficiency=eff, host_bw=gbps * 1e9)
        if best is None or e < best[0]:
            best = (e, gbps * 1e9)
    return best[1]


def describe(r):
    opts = [r["attention"]] + [k for k in ("checkpoint_layers", "keep_attention", "atomic_dq", "offload") if r.get(k)]
    if not r.get("reference", True):
        opts.append("no reference")
    return f"{r['shape']} {r['answers']}x{r['seq_len']} mb{r['micro_batch']} {'+'.join(opts)}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grpo", default=str(ROOT / "target/debug/grpo"))
    ap.add_argument("results", nargs="*")
    a = ap.parse_args()
    files = a.results or sorted(glob.glob(str(ROOT / "benches/results/gpu-*-h100.jsonl")))
    points = []
    for f in files:
        for line in Path(f).read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("bench") == "train_step" and r.get("impl") == "grpo" and "H100" in r.get("device", ""):
                points.append({"record": r, "measured": r["step_time_s"], "windows": windows(a.grpo, r, file_tag(f)),
                               "file": Path(f).name})
    if not points:
        sys.exit("calibrate: no H100 train steps of grpo in " + ", ".join(files))
    plain = [p for p in points if not p["record"].get("offload")]
    # Offloaded steps of the build the 2026-11-26 run measured (the composite host update, whose rate is
    # fitted); this build's update runs at the rate `grpo bench optimizer` measured (src/cost/calibration.rs).
    composite = [p for p in points if p["record"].get("offload") and p["record"].get("update") != "fused"]
    launch_s, eff = fit_host(plain)
    host_bw = fit_update(composite, launch_s, eff) if composite else 1e11
    for p in points:
        p["host_bw"] = host_bw if p in composite else None
    print(f"fitted on {len(plain)} steps without offload: launch_s = {launch_s * 1e6:.2f} us, "
          f"memory_efficiency = {eff:.2f}")
    print(f"fitted on {len(composite)} offloaded steps of the composite update: composite_host_update_bandwidth "
          f"= {host_bw / 1e9:.2f} GB/s" + ("" if composite else " (none measured: default)"))
    k = points[0]["windows"][0]["kernel_launch_s"]
    print(f"measured, not fitted: kernel_launch_s = {k * 1e6:.1f} us; assumed: PCIe {PCIE / 1e9:.0f} GB/s\n")
    print(f"{'step':<70} {'measured s':>10} {'predicted s':>11} {'pred/meas':>9}  fitted on")
    worst = 0.0
    for p in points:
        pred = predict(p["windows"], launch_s, eff, p["host_bw"])
        ratio = pred / p["measured"]
        worst = max(worst, abs(math.log(ratio)))
        role = ("composite_host_update_bandwidth" if p in composite else
                "not fitted on" if p["record"].get("offload") else "launch_s, memory_efficiency")
        print(f"{describe(p['record']):<70} {p['measured']:>10.3f} {pred:>11.3f} {ratio:>9.3f}  {role}")
    print(f"\nworst residual: x{math.exp(worst):.3f}")


if __name__ == "__main__":
    main()
