"""One JSON line of run.sh's seed7b part: the measured peak of one training step at the 7B shape beside
`grpo train --plan`'s prediction for the same micro-batch.

    seed7b.py WORKDIR RC RESPONSE_TOKENS PROMPT_TOKENS DEVICE SHAPE [ANSWERS]   (ANSWERS: 8)

WORKDIR holds plan.txt (the plan's output), bench.txt / bench.err (`grpo bench train-step`, exit status RC)
and, on a GPU, smi.txt (nvidia-smi's memory.used in MiB, one sample per line).

The plan's device peak (its tensors with the memory pool's overheads, and the CUDA context) is put
beside nvidia-smi's highest memory.used (`plan_over_smi`), and its tensors' training peak (resident + step
+ max(backward, update); the bench runs no validation) beside the pool's peak in use, the bench's
`peak_mem_bytes` (`plan_tensors_over_pool`).
"""
import json
import re
import sys
from pathlib import Path

GIB = 1 << 30


def plan_numbers(text):
    """The plan's peaks: on a GPU its device peak (pool + context) and its tensors' peak by phase."""
    peak = re.search(r"device peak: [\d.]+ GiB \((\d+) bytes\)", text)
    m = re.search(r"(?:tensors' peak|device peak): [\d.]+ GiB.*?= resident ([\d.]+) GiB \+ max\(step ([\d.]+) GiB"
                  r" \+ max\(backward ([\d.]+) GiB, update ([\d.]+) GiB\), validation ([\d.]+) GiB", text)
    if not (peak and m):
        return None
    resident, step, backward, update, validation = (float(m.group(i)) * GIB for i in range(1, 6))
    return {"plan_peak_bytes": int(peak.group(1)), "plan_tensor_train_peak_bytes": int(resident + step + max(backward, update)),
            "plan_validation_bytes": int(validation)}


def main():
    work, rc, device, shape = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[5], Path(sys.argv[6]).name
    response, prompt = int(sys.argv[3]), int(sys.argv[4])
    answers = int(sys.argv[7]) if len(sys.argv) > 7 else 8
    rec = {"bench": "seed7b", "what": f"train step, {shape}, {answers} x ({prompt} + {response}) tokens, seed settings",
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
    smi = work / "smi.txt"
    if smi.exists():
        used = [int(l) for l in smi.read_text().split() if l.strip().isdigit()]
        rec["nvidia_smi_max_used_bytes"] = max(used) * (1 << 20) if used else None
    # The plan's device peak is what nvidia-smi sees (tensors, the pool's overheads, the context); its
    # tensors' training peak is what the pool has in use at once.
    if rec.get("nvidia_smi_max_used_bytes") and rec.get("plan_peak_bytes"):
        rec["plan_over_smi"] = round(rec["plan_peak_bytes"] / rec["nvidia_smi_max_used_bytes"], 3)
    if rec.get("pool_peak_bytes") and rec.get("plan_tensor_train_peak_bytes"):
        rec["plan_tensors_over_pool"] = round(rec["plan_tensor_train_peak_bytes"] / rec["pool_peak_bytes"], 3)
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
