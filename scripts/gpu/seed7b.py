"""One JSON line of run.sh's seed7b part: the measured peak of one training step at the 7B shape beside
`grpo train --plan`'s prediction for the same micro-batch.

    seed7b.py WORKDIR RC RESPONSE_TOKENS PROMPT_TOKENS DEVICE SHAPE

WORKDIR holds plan.txt (the plan's output), bench.txt / bench.err (`grpo bench train-step`, exit status RC)
and, on a GPU, smi.txt (nvidia-smi's memory.used in MiB, one sample per line).

The plan's training peak is resident + step + max(backward, update) (its validation phase is not run by
the bench); it includes the CUDA context (1 GiB), which the bench's peak (candle's pool high-water mark)
does not, so `pool_peak_plus_context_bytes` is the number to put beside it; nvidia-smi's highest
memory.used also counts memory the pool keeps in reserve.
"""
import json
import re
import sys
from pathlib import Path

GIB = 1 << 30
CONTEXT = GIB  # src/cost/memory.rs CUDA_CONTEXT_BYTES


def plan_numbers(text):
    m = re.search(r"device peak: [\d.]+ GiB \((\d+) bytes\) = resident ([\d.]+) GiB \+ max\(step ([\d.]+) GiB"
                  r" \+ max\(backward ([\d.]+) GiB, update ([\d.]+) GiB\), validation ([\d.]+) GiB(?:, rollouts [\d.]+ GiB)?\)",
                  text)
    if not m:
        return None
    peak = int(m.group(1))
    resident, step, backward, update, validation = (float(m.group(i)) * GIB for i in range(2, 7))
    return {"plan_peak_bytes": peak, "plan_train_peak_bytes": int(resident + step + max(backward, update)),
            "plan_validation_bytes": int(validation)}


def main():
    work, rc, device, shape = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[5], Path(sys.argv[6]).name
    response, prompt = int(sys.argv[3]), int(sys.argv[4])
    rec = {"bench": "seed7b", "what": f"train step, {shape}, 8 x ({prompt} + {response}) tokens, seed settings",
           "device": device, "shape": shape, "response_tokens": response, "prompt_tokens": prompt}
    plan_text = (work / "plan.txt").read_text() if (work / "plan.txt").exists() else ""
    rec.update(plan_numbers(plan_text) or {"plan_error": plan_text[-600:]})
    bench = [l for l in (work / "bench.txt").read_text().splitlines() if l.startswith("{")] \
        if (work / "bench.txt").exists() else []
    if rc != 0 or not bench:
        err = (work / "bench.err").read_text()[-600:] if (work / "bench.err").exists() else ""
        rec.update({"passed": False, "message": f"exit {rc}: {err}"})
    else:
        b = json.loads(bench[-1])
        rec.update({"passed": True, "step_time_s": b.get("step_time_s"), "losses": b.get("losses"),
                    "pool_peak_bytes": b.get("peak_mem_bytes")})
        if b.get("peak_mem_bytes") is not None:
            rec["pool_peak_plus_context_bytes"] = b["peak_mem_bytes"] + CONTEXT
    smi = work / "smi.txt"
    if smi.exists():
        used = [int(l) for l in smi.read_text().split() if l.strip().isdigit()]
        rec["nvidia_smi_max_used_bytes"] = max(used) * (1 << 20) if used else None
    measured = rec.get("pool_peak_plus_context_bytes") or rec.get("nvidia_smi_max_used_bytes")
    if measured and rec.get("plan_train_peak_bytes"):
        rec["plan_over_measured"] = round(rec["plan_train_peak_bytes"] / measured, 3)
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
