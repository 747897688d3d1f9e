"""Merge the benchmark lines of torch_ref.py and `grpo bench` into tables and one JSON report.

Usage:
  python scripts/gpu/report.py RESULTS.jsonl OUT.json      # DATE=YYYY-MM-DD overrides today

RESULTS.jsonl holds the JSON lines of both sides; anything that is not a JSON object is ignored.
Ours are "impl": "grpo" (train_step, generate) or "grpo_fused" / "grpo_naive" (logprob); the
reference is "torch" or "torch_naive". A line {"bench": "error", "what", "message"} is kept and shown.
Lines {"bench": "seed7b", ...} (planned vs measured peak memory at the 7B shape), {"bench": "attention", ...}
(one layer's attention, chunked GEMMs or tensor-core kernels) and {"bench": "gemm", ...} (one layer's projection
GEMMs) are printed as they are.
Lines {"bench": "optimizer", ...} (the offloaded update against its reference) are printed too, and a
train_step record's "kernel_profile" (torch_ref.py --profile: CUDA time by attention, GEMMs and the rest).
Lines {"bench": "correctness" | "smoke", "what", "passed", ...} (run.sh's CUDA tests and GPU smoke
run) are shown too, and {"bench": "skipped", "what", "reason"} lines (steps a run left out) are listed.
Predicted vs measured: every train_step line of ours that carries `predicted` (the performance model's step per
GPU, src/cost/) gets a row with its measured step, the prediction for the card that ran (the entry with
`measured_over_predicted`; on the CPU, where none has one, the first GPU's prediction is shown without a ratio)
and the ratio; the rows are in the JSON as "predictions".
Pairs are made on (shape, answers, seq_len) for train_step, (tokens, hidden, vocab, with_loss)
for logprob and (shape, batch, new_tokens) for generate. Every line of ours gets a row against
the last torch line of its key (so several runs of ours, e.g. with different checkpoint_layers,
each get one, its settings shown under "notes"); a key with only one side still gets a row.

Ratios: speedup = our speed / torch speed (> 1: ours is faster; tokens/s for train_step and
generate, inverse times for logprob); mem_ratio = our peak / torch peak (< 1: ours uses less).

FLOPs and MFU (train_step only, the same formula for both sides), from shapes/<shape>.json:
  P = L * (H*nh*hd + 2*H*nkv*hd + nh*hd*H + 3*H*I) + V*H
      the parameters of matmuls: q, k, v, o, gate, up, down of every layer plus the lm_head;
      the input embedding lookup is not a matmul and is excluded even when tied to the lm_head
      (biases and norms are excluded too).
  forward FLOPs of one sequence of T tokens = 2*P*T + 2*2*L*T^2*nh*hd / 2
      (QK^T and AV, 2*T^2*nh*hd each, halved for the causal mask)
  FLOPs per train step = answers * (3 + 1) * forward(seq_len)
      (policy forward + backward = 3 forwards, reference = 1 forward; 3 for a record with
      "reference": false, whose step has no reference forward: the recomputed forward of
      checkpointed layers is not counted either)
  MFU = FLOPs per step / step_time_s / peak dense bf16 FLOP/s of the card named in "device"
      (H100 SXM / H100 80GB HBM3 and H200: 989.4e12, H100 PCIe: 756e12, A100: 312e12;
      any other card: null).
"""

import datetime
import json
import os
import sys
from pathlib import Path

SHAPES = Path(__file__).resolve().parent / "shapes"
# Shapes named after a model config of the project (configs/models/NAME.json), as the 7B bench names it.
MODEL_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
KEYS = {
    "train_step": ("shape", "answers", "seq_len"),
    "logprob": ("tokens", "hidden", "vocab", "with_loss"),
    "generate": ("shape", "batch", "new_tokens"),
}
OURS = {"grpo", "grpo_fused", "grpo_naive"}
# Settings of our lines that tell apart several runs on one key.
VARIANTS = ("micro_batch", "checkpoint_layers", "logprob_chunk_mb", "chunk_mb", "fused_ops", "attention", "atomic_dq",
            "keep_attention", "offload", "reference", "schedule")
TORCH = {"torch", "torch_naive"}
GIB = 2**30


def load(path):
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return records


def peak_flops(device):
    """Peak dense bf16 FLOP/s of a card from its CUDA name, or None when unknown."""
    name = (device or "").upper()
    if "H200" in name:
        return 989.4e12
    if "H100" in name and "PCIE" in name:
        return 756e12
    if "H100" in name and ("SXM" in name or "HBM3" in name):
        return 989.4e12
    if "A100" in name:
        return 312e12
    return None


def train_step_flops(shape, answers, seq_len, reference=True):
    path = SHAPES / f"{shape}.json"
    cfg = json.loads((path if path.exists() else MODEL_CONFIGS / f"{shape}.json").read_text())
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    per_layer = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
    per_layer += 3 * h * cfg["intermediate_size"]
    params = layers * per_layer + vocab * h
    t = seq_len
    forward = 2 * params * t + 2 * 2 * layers * t * t * heads * head_dim / 2
    return answers * (3 + (1 if reference else 0)) * forward


def ratio(a, b):
    return a / b if a is not None and b else None


def mfu(flops, rec):
    if rec is None or flops is None or not rec.get("step_time_s"):
        return None
    peak = peak_flops(rec.get("device"))
    return flops / rec["step_time_s"] / peak if peak else None


def get(rec, key):
    return None if rec is None else rec.get(key)


def compare(bench, key, ours, torch):
    row = {"bench": bench, "key": key, "ours": ours, "torch": torch}
    if bench == "train_step":
        try:
            # Each side's own FLOPs: a step without a reference model (ours with --no-reference) has no
            # reference forward.
            flops = {side: train_step_flops(key["shape"], key["answers"], key["seq_len"],
                                            (get(rec, "reference") is not False))
                     for side, rec in (("ours", ours), ("torch", torch))}
        except (OSError, KeyError, TypeError) as e:
            print(f"no FLOPs for shape {key['shape']!r}: {e!r}", file=sys.stderr)
            flops = {"ours": None, "torch": None}
        row["flops_per_step"] = flops["ours"]
        row["mfu_ours"] = mfu(flops["ours"], ours)
        row["mfu_torch"] = mfu(flops["torch"], torch)
        row["speedup"] = ratio(get(ours, "tokens_per_s"), get(torch, "tokens_per_s"))
    elif bench == "logprob":
        row["speedup"] = ratio(get(torch, "fwd_bwd_time_s"), get(ours, "fwd_bwd_time_s"))
        row["fwd_speedup"] = ratio(get(torch, "fwd_time_s"), get(ours, "fwd_time_s"))
    else:
        row["speedup"] = ratio(get(ours, "tokens_per_s"), get(torch, "tokens_per_s"))
    if bench != "generate":
        row["mem_ratio"] = ratio(get(ours, "peak_mem_bytes"), get(torch, "peak_mem_bytes"))
    return row


def comparisons(records):
    rows = []
    for bench, names in KEYS.items():
        groups = {}  # key -> (ours records, last torch record), in order of first appearance
        for rec in records:
            if rec.get("bench") != bench or rec.get("impl") not in OURS | TORCH:
                continue
            key = tuple(rec.get(n) for n in names)
            ours, torch = groups.setdefault(key, ([], [None]))
            if rec["impl"] in OURS:
                ours.append(rec)
            else:
                torch[0] = rec
        for key, (ours, torch) in groups.items():
            for o in ours or [None]:
                rows.append(compare(bench, dict(zip(names, key)), o, torch[0]))
    return rows


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def gib(rec):
    b = get(rec, "peak_mem_bytes")
    return None if b is None else b / GIB


def notes(row):
    out = []
    if get(row["torch"], "grad_ckpt"):
        out.append("torch: grad ckpt" + (" (OOM without)" if row["torch"].get("oom_without_ckpt") else ""))
    ours = row["ours"] or {}
    settings = [f"{k}={ours[k]}" for k in VARIANTS if ours.get(k) is not None]
    if ours.get("impl", "grpo") != "grpo" or settings:
        out.append(" ".join([f"ours: {ours['impl']}"] + settings))
    return "; ".join(out)


def table(title, header, lines):
    widths = [max(len(str(c)) for c in col) for col in zip(header, *lines)]
    print(f"\n== {title}")
    for cells in [header, *lines]:
        print("  ".join(str(c).rjust(w) for c, w in zip(cells, widths)).rstrip())


def print_tables(rows):
    by_bench = {b: [r for r in rows if r["bench"] == b] for b in KEYS}
    table("train_step (tokens/s over all tokens, peak GiB)",
          ["shape", "answers", "seq_len", "ours tok/s", "torch tok/s", "speedup", "ours GiB",
           "torch GiB", "mem ratio", "ours MFU", "torch MFU", "notes"],
          [[r["key"]["shape"], r["key"]["answers"], r["key"]["seq_len"],
            fmt(get(r["ours"], "tokens_per_s"), ".0f"), fmt(get(r["torch"], "tokens_per_s"), ".0f"),
            fmt(r["speedup"], ".2f"), fmt(gib(r["ours"]), ".2f"), fmt(gib(r["torch"]), ".2f"),
            fmt(r["mem_ratio"], ".2f"), fmt(r["mfu_ours"], ".1%"), fmt(r["mfu_torch"], ".1%"), notes(r)]
           for r in by_bench["train_step"]])
    def ms(rec, k):
        return None if get(rec, k) is None else rec[k] * 1e3

    table("logprob (ms, peak GiB above the inputs)",
          ["tokens", "hidden", "vocab", "with_loss", "ours fwd", "torch fwd", "fwd speedup", "ours f+b",
           "torch f+b", "speedup", "ours GiB", "torch GiB", "mem ratio", "notes"],
          [[r["key"]["tokens"], r["key"]["hidden"], r["key"]["vocab"], r["key"]["with_loss"],
            fmt(ms(r["ours"], "fwd_time_s"), ".2f"), fmt(ms(r["torch"], "fwd_time_s"), ".2f"),
            fmt(r["fwd_speedup"], ".2f"), fmt(ms(r["ours"], "fwd_bwd_time_s"), ".2f"),
            fmt(ms(r["torch"], "fwd_bwd_time_s"), ".2f"), fmt(r["speedup"], ".2f"),
            fmt(gib(r["ours"]), ".2f"), fmt(gib(r["torch"]), ".2f"), fmt(r["mem_ratio"], ".2f"),
            notes(r)]
           for r in by_bench["logprob"]])
    table("generate (new tokens/s over the batch)",
          ["shape", "batch", "new_tokens", "ours tok/s", "torch tok/s", "speedup", "notes"],
          [[r["key"]["shape"], r["key"]["batch"], r["key"]["new_tokens"],
            fmt(get(r["ours"], "tokens_per_s"), ".1f"), fmt(get(r["torch"], "tokens_per_s"), ".1f"),
            fmt(r["speedup"], ".2f"), notes(r)]
           for r in by_bench["generate"]])


def variant(rec):
    """What tells apart our train_step lines on one key, short: attention, checkpointing, offload, micro-batch."""
    out = [rec.get("attention") or "flash"]
    out += [name for name, on in (("ckpt", rec.get("checkpoint_layers")), ("keep", rec.get("keep_attention")),
                                  ("atomic-dq", rec.get("atomic_dq")), ("offload", rec.get("offload")),
                                  ("no-ref", rec.get("reference") is False)) if on]
    return " ".join(out + [f"mb{rec.get('micro_batch')}"])


def predictions(records):
    """One row per train_step line of ours with a prediction: measured step beside the model's."""
    rows = []
    for rec in records:
        if rec.get("bench") != "train_step" or rec.get("impl") not in OURS or not rec.get("predicted"):
            continue
        preds = rec["predicted"]
        pred = next((p for p in preds if p.get("measured_over_predicted") is not None), preds[0])
        rows.append({"shape": rec.get("shape"), "answers": rec.get("answers"), "seq_len": rec.get("seq_len"),
                     "variant": variant(rec), "device": rec.get("device"), "measured_s": rec.get("step_time_s"),
                     "predicted_gpu": pred.get("gpu"), "predicted_s": pred.get("step_time_s"),
                     "calibrated_on": pred.get("calibrated_on"),
                     "measured_over_predicted": pred.get("measured_over_predicted")})
    return rows


def print_predictions(rows):
    table("predicted vs measured train step (performance model, src/cost/; ratio on the card that ran)",
          ["shape", "answers", "seq_len", "variant", "measured s", "predicted s", "on", "measured/predicted"],
          [[r["shape"], r["answers"], r["seq_len"], r["variant"], fmt(r["measured_s"], ".3f"),
            fmt(r["predicted_s"], ".3f"), r["predicted_gpu"], fmt(r["measured_over_predicted"], ".2f")]
           for r in rows])


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    records = load(sys.argv[1])
    rows = comparisons(records)
    devices = sorted({r["device"] for r in records if r.get("device")})
    report = {
        "date": os.environ.get("DATE") or datetime.date.today().isoformat(),
        "device": ", ".join(devices) or None,
        "results": records,
        "comparisons": rows,
        "correctness": [r for r in records if r.get("bench") in ("correctness", "smoke")],
        "predictions": predictions(records),
    }
    print(f"{report['date']} on {report['device']}")
    print_tables(rows)
    print_predictions(report["predictions"])
    for t in (r for r in records if r.get("bench") == "correctness"):
        print(f"\ncorrectness {t.get('what')}: {'PASSED' if t.get('passed') else 'FAILED'} "
              f"({t.get('tests_ok')} tests ok)")
    for t in (r for r in records if r.get("bench") == "smoke"):
        print(f"\nsmoke {t.get('what')}: {'PASSED' if t.get('passed') else 'FAILED'}; losses {t.get('losses')}")
    for t in (r for r in records if r.get("bench") == "train_step" and r.get("kernel_profile")):
        k = t["kernel_profile"]
        print(f"\nPyTorch's step under torch.profiler, {t.get('shape')} {t.get('answers')} x {t.get('seq_len')}: "
              f"attention {k.get('attention_ms', 0):.1f} ms, GEMMs {k.get('gemm_ms', 0):.1f} ms, other kernels "
              f"{k.get('other_ms', 0):.1f} ms (timed step {t.get('step_time_s', 0):.3f} s)")
        for name, ms, count in k.get("top", []):
            print(f"  {ms:9.2f} ms {count:6d}x  {name}")
    for t in (r for r in records if r.get("bench") == "seed7b"):
        gib = lambda b: f"{b / 2**30:.1f} GiB" if b else "n/a"
        print(f"\nseed7b {t.get('what')}: {'ran' if t.get('passed') else 'FAILED'}; plan's device peak "
              f"{gib(t.get('plan_peak_bytes'))}, nvidia-smi {gib(t.get('nvidia_smi_max_used_bytes'))} "
              f"(plan / smi {t.get('plan_over_smi')}); plan's tensors {gib(t.get('plan_tensor_train_peak_bytes'))}, "
              f"pool in use {gib(t.get('pool_peak_bytes'))} (plan / pool {t.get('plan_tensors_over_pool')})")
    for t in (r for r in records if r.get("bench") == "attention"):
        print(f"\nattention {t.get('kernel')}{' atomic-dq' if t.get('atomic_dq') else ''} {t.get('dtype')} "
              f"{t.get('heads')}x{t.get('head_dim')} (kv {t.get('kv_heads')}) len {t.get('len')}: {t.get('seconds', 0):.4f} s, "
              f"{t.get('gflops', 0) / 1e3:.1f} TFLOP/s useful ({t.get('dtype')} matmul {t.get('matmul_gflops', 0) / 1e3:.1f}, "
              f"ratio {t.get('ratio', 0):.2f}); forward {t.get('forward_gflops', 0) / 1e3:.1f} TFLOP/s "
              f"(ratio {t.get('forward_ratio', 0):.2f}), backward {(t.get('backward_gflops') or 0) / 1e3:.1f} "
              f"(ratio {(t.get('backward_ratio') or 0):.2f})")
    for t in (r for r in records if r.get("bench") == "gemm"):
        rates = ", ".join(f"{g['name']} {g['tflops']:.0f}" for g in t.get("gemms", []))
        assumed = ", ".join(f"{a['gpu']} {a['tflops']:.0f}" for a in t.get("assumed", []))
        print(f"\ngemm {t.get('shape')} {t.get('dtype')} {t.get('tokens')} rows: {t.get('tflops', 0):.1f} TFLOP/s over "
              f"the layer's projections (the model assumes {assumed}); {rates}")
    for t in (r for r in records if r.get("bench") == "optimizer"):
        print(f"\noptimizer {t.get('device')} {t.get('dtype')} {t.get('params')} params: {t.get('fused_s', 0):.3f} s "
              f"({t.get('fused_gb_per_s', 0):.1f} GB/s of 32 B a parameter) against {t.get('reference')} "
              f"{t.get('reference_s', 0):.3f} s, {t.get('speedup', 0):.2f}x; {t.get('pcie_bytes', 0) / 1e9:.2f} GB over "
              f"PCIe; same bits: {t.get('same_bits')}"
              + "".join(f"; predicted on {p['gpu']} {p['seconds']:.3f} s"
                        + (f" (measured / predicted {p['measured_over_predicted']:.2f})"
                           if p.get("measured_over_predicted") else "")
                        for p in t.get("predicted", [])))
    for t in (r for r in records if r.get("bench") == "skipped"):
        print(f"\nskipped {t.get('what')}: {t.get('reason')}")
    for err in (r for r in records if r.get("bench") == "error"):
        print(f"\nERROR in {err.get('what')}: {err.get('message')}")
    Path(sys.argv[2]).write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {sys.argv[2]}")


if __name__ == "__main__":
    main()
